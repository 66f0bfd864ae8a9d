//! Build steps:
//! 1. Generates `include/pdxfer.h` from the Rust sources with cbindgen. The
//!    header is committed; the test command regenerates it and fails when the
//!    committed copy differs (`git diff --exit-code include/pdxfer.h`).
//! 2. Embeds the CUDA relayout kernels (`cuda/relayout.cu`): always the source
//!    (compiled at run time by NVRTC), plus sm_90 PTX and an sm_90 cubin when
//!    `nvcc` is found (`$PDXFER_NVCC`, `$CUDA_HOME/bin/nvcc`, then `PATH`).
//!    Without nvcc the build still succeeds; see `relayout::gpu::kernels`.
//! 3. Gives the cdylib the soname `libpdxfer.so.<ABI major>` (the major of
//!    `src/ffi/status.rs`), so programs linked against it keep working across
//!    minor versions and refuse another major at load time.
use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    let crate_dir =
        PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    header(&crate_dir);
    kernels(&crate_dir);
    soname(&crate_dir);
}

/// The value of `pub const NAME: u32 = N;` in `src`.
fn const_u32(src: &str, name: &str) -> u32 {
    let pat = format!("pub const {name}: u32 = ");
    src.lines()
        .find_map(|l| l.trim().strip_prefix(&pat)?.strip_suffix(';')?.parse().ok())
        .unwrap_or_else(|| panic!("src/ffi/status.rs has no `{pat}N;`"))
}

fn soname(crate_dir: &Path) {
    let status = crate_dir.join("src/ffi/status.rs");
    println!("cargo:rerun-if-changed=src/ffi/status.rs");
    let src = std::fs::read_to_string(&status).expect("read src/ffi/status.rs");
    let major = const_u32(&src, "PDXFER_ABI_VERSION_MAJOR");
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux") {
        println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libpdxfer.so.{major}");
    }
}

fn header(crate_dir: &Path) {
    println!("cargo:rerun-if-changed=src/ffi");
    println!("cargo:rerun-if-changed=src/error.rs");
    println!("cargo:rerun-if-changed=cbindgen.toml");
    let config =
        cbindgen::Config::from_file(crate_dir.join("cbindgen.toml")).expect("read cbindgen.toml");
    std::fs::create_dir_all(crate_dir.join("include")).expect("create include/");
    match cbindgen::Builder::new()
        .with_crate(crate_dir)
        .with_config(config)
        .generate()
    {
        Ok(bindings) => {
            bindings.write_to_file(crate_dir.join("include/pdxfer.h"));
        }
        Err(e) => {
            // A parse failure here is a bug in our sources; rustc reports it better.
            println!("cargo:warning=cbindgen could not generate include/pdxfer.h: {e}");
        }
    }
}

/// The nvcc to use, if any.
fn find_nvcc() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("PDXFER_NVCC") {
        return Some(PathBuf::from(p));
    }
    if let Some(h) = std::env::var_os("CUDA_HOME") {
        let p = PathBuf::from(h).join("bin/nvcc");
        if p.is_file() {
            return Some(p);
        }
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join("nvcc"))
        .find(|p| p.is_file())
}

/// Runs nvcc with `args`; true when it succeeded.
fn nvcc(nvcc: &Path, args: &[&str], src: &Path, out: &Path) -> bool {
    match Command::new(nvcc)
        .args(args)
        .arg("-o")
        .arg(out)
        .arg(src)
        .output()
    {
        Ok(o) if o.status.success() => true,
        Ok(o) => {
            println!(
                "cargo:warning=nvcc {} failed; embedding the kernel source only (NVRTC at run time): {}",
                args.join(" "),
                String::from_utf8_lossy(&o.stderr).lines().next().unwrap_or("")
            );
            false
        }
        Err(e) => {
            println!(
                "cargo:warning=cannot run {}: {e}; embedding the kernel source only",
                nvcc.display()
            );
            false
        }
    }
}

fn kernels(crate_dir: &Path) {
    let src = crate_dir.join("cuda/relayout.cu");
    println!("cargo:rerun-if-changed=cuda/relayout.cu");
    println!("cargo:rerun-if-env-changed=PDXFER_NVCC");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    let out_dir = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let ptx = out_dir.join("relayout_sm90.ptx");
    let cubin = out_dir.join("relayout_sm90.cubin");
    let (mut have_ptx, mut have_cubin, mut version) = (false, false, String::new());
    if let Some(n) = find_nvcc() {
        have_ptx = nvcc(&n, &["-arch=sm_90", "-ptx"], &src, &ptx);
        have_cubin = have_ptx && nvcc(&n, &["-arch=sm_90", "-cubin"], &src, &cubin);
        if let Ok(o) = Command::new(&n).arg("--version").output() {
            version = String::from_utf8_lossy(&o.stdout)
                .lines()
                .last()
                .unwrap_or("")
                .trim()
                .to_string();
        }
    }
    let opt = |have: bool, inc: &str, p: &Path| {
        if have {
            format!("Some({inc}!({:?}))", p.display().to_string())
        } else {
            "None".to_string()
        }
    };
    let code = format!(
        "/// CUDA source of the relayout kernels (`cuda/relayout.cu`), for NVRTC.\n\
         pub const SOURCE: &str = include_str!({:?});\n\
         /// sm_90 PTX from nvcc at build time, if nvcc was found.\n\
         pub const PTX_SM90: Option<&str> = {};\n\
         /// sm_90 cubin from nvcc at build time, if nvcc was found.\n\
         pub const CUBIN_SM90: Option<&[u8]> = {};\n\
         /// The nvcc that built them (`--version`, last line), empty if none.\n\
         pub const NVCC_VERSION: &str = {:?};\n",
        src.display().to_string(),
        opt(have_ptx, "include_str", &ptx),
        opt(have_cubin, "include_bytes", &cubin),
        version
    );
    std::fs::write(out_dir.join("kernels.rs"), code).expect("write kernels.rs");
}
