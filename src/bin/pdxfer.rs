//! The `pdxfer` command line.
fn main() {
    std::process::exit(pdxfer::cli::main());
}
