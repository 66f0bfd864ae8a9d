//! Build steps:
//! 1. Generates `include/pdxfer.h` from the Rust sources with cbindgen. The
//!    header is committed; the test command regenerates it and fails when the
//!    committed copy differs (`git diff --exit-code include/pdxfer.h`).
//! 2. Embeds the CUDA relayout kernels (`cuda/relayout.cu`): always the source
//!    (compiled at run time by NVRTC), plus sm_90 PTX and an sm_90 cubin from
//!    each compiler found: `nvcc` (`$PDXFER_NVCC`, `$CUDA_HOME/bin/nvcc`, then
//!    `PATH`) and every NVRTC library named in `$PDXFER_KERNEL_NVRTC`
//!    (`:`-separated paths, e.g. the CUDA 12.4 `libnvrtc.so.12` that
//!    `scripts/cuda-deps.sh` installs, whose images load on CUDA 12.x drivers).
//!    When none of those is a CUDA 12 NVRTC, the first `libnvrtc.so.12` found
//!    the way pdxfer finds NVRTC at run time (`src/cuda/library.rs`: the
//!    loader path and pip's site-packages, including those of the Python that
//!    runs the build, so `pip install .` finds the `nvidia-cuda-nvrtc-cu12`
//!    build requirement) compiles the CUDA 12 images. A release build without
//!    a CUDA 12 cubin fails, saying how to get one, unless
//!    `PDXFER_KERNELS_WITHOUT_CUDA12=1` accepts it; other builds only warn.
//!    See `relayout::gpu::kernels`.
//! 3. Gives the cdylib the soname `libpdxfer.so.<ABI major>` (the major of
//!    `src/version.rs`), so programs linked against it keep working across
//!    minor versions and refuse another major at load time.
use std::path::{Path, PathBuf};
use std::process::Command;

#[allow(dead_code)]
#[path = "src/relayout/gpu/nvrtc.rs"]
mod nvrtc;

#[allow(dead_code)]
#[path = "src/cuda/library.rs"]
mod library;

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
        .unwrap_or_else(|| panic!("src/version.rs has no `{pat}N;`"))
}

fn soname(crate_dir: &Path) {
    let version = crate_dir.join("src/version.rs");
    println!("cargo:rerun-if-changed=src/version.rs");
    let src = std::fs::read_to_string(&version).expect("read src/version.rs");
    let major = const_u32(&src, "PDXFER_ABI_VERSION_MAJOR");
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux") {
        println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libpdxfer.so.{major}");
    }
}

fn header(crate_dir: &Path) {
    println!("cargo:rerun-if-changed=src/ffi");
    println!("cargo:rerun-if-changed=src/error.rs");
    println!("cargo:rerun-if-changed=src/version.rs");
    println!("cargo:rerun-if-changed=cbindgen.toml");
    let mut config =
        cbindgen::Config::from_file(crate_dir.join("cbindgen.toml")).expect("read cbindgen.toml");
    std::fs::create_dir_all(crate_dir.join("include")).expect("create include/");
    let generate = |config: &cbindgen::Config| {
        cbindgen::Builder::new()
            .with_crate(crate_dir)
            .with_config(config.clone())
            .generate()
    };
    // cbindgen exports every `pub const` of the crate as a macro. Internal
    // constants (wire versions, limits) must not reach C users, where names
    // like `VERSION` collide with autoconf's: a first pass finds the unprefixed
    // macros, the second pass excludes them. `tests/abi/header.rs` checks the result.
    let bindings = generate(&config).and_then(|first| {
        let mut text = Vec::new();
        first.write(&mut text);
        let internal = unprefixed_macros(&String::from_utf8_lossy(&text), &config);
        if internal.is_empty() {
            return Ok(first);
        }
        config.export.exclude.extend(internal);
        generate(&config)
    });
    match bindings {
        Ok(bindings) => {
            bindings.write_to_file(crate_dir.join("include/pdxfer.h"));
        }
        Err(e) => {
            // A parse failure here is a bug in our sources; rustc reports it better.
            println!("cargo:warning=cbindgen could not generate include/pdxfer.h: {e}");
        }
    }
}

/// Names of the `#define`d macros in `header` that lack the `PDXFER_` prefix,
/// except the include guard.
fn unprefixed_macros(header: &str, config: &cbindgen::Config) -> Vec<String> {
    header
        .lines()
        .filter_map(|l| l.trim_start().strip_prefix("#define "))
        .filter_map(|rest| rest.split_whitespace().next())
        .filter(|name| !name.starts_with("PDXFER_"))
        .filter(|name| config.include_guard.as_deref() != Some(*name))
        .map(|name| name.split('(').next().unwrap_or(name).to_string())
        .collect()
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

/// One image to embed: kind ("Cubin"/"Ptx"), toolkit (major, minor), compiler, file.
struct Image {
    kind: &'static str,
    toolkit: (u32, u32),
    compiler: String,
    file: PathBuf,
}

/// `(major, minor, "13.5.37")` from nvcc's "release 13.5, V13.5.37" line.
fn nvcc_release(nvcc: &Path) -> Option<(u32, u32, String)> {
    let o = Command::new(nvcc).arg("--version").output().ok()?;
    let text = String::from_utf8_lossy(&o.stdout).into_owned();
    let at = text.find("release ")? + "release ".len();
    let ver = text[at..]
        .split(|c: char| c == ',' || c.is_whitespace())
        .next()?;
    let mut it = ver.split('.');
    let major = it.next()?.parse().ok()?;
    let minor = it.next()?.parse().ok()?;
    let full = text[at..]
        .split_whitespace()
        .find_map(|w| w.strip_prefix('V'))
        .unwrap_or(ver)
        .to_string();
    Some((major, minor, full))
}

fn kernels(crate_dir: &Path) {
    let src = crate_dir.join("cuda/relayout.cu");
    println!("cargo:rerun-if-changed=cuda/relayout.cu");
    println!("cargo:rerun-if-changed=src/relayout/gpu/nvrtc.rs");
    println!("cargo:rerun-if-env-changed=PDXFER_NVCC");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    println!("cargo:rerun-if-env-changed=PDXFER_KERNEL_NVRTC");
    let out_dir = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let mut images: Vec<Image> = Vec::new();
    if let Some(n) = find_nvcc() {
        match nvcc_release(&n) {
            Some((major, minor, full)) => {
                let tag = format!("cu{major}{minor}");
                let ptx = out_dir.join(format!("relayout_sm90_{tag}_nvcc.ptx"));
                let cubin = out_dir.join(format!("relayout_sm90_{tag}_nvcc.cubin"));
                let compiler = format!("nvcc {full}");
                if nvcc(&n, &["-arch=sm_90", "-ptx"], &src, &ptx) {
                    if nvcc(&n, &["-arch=sm_90", "-cubin"], &src, &cubin) {
                        images.push(Image {
                            kind: "Cubin",
                            toolkit: (major, minor),
                            compiler: compiler.clone(),
                            file: cubin,
                        });
                    }
                    images.push(Image {
                        kind: "Ptx",
                        toolkit: (major, minor),
                        compiler,
                        file: ptx,
                    });
                }
            }
            None => println!(
                "cargo:warning=cannot read the CUDA release from `{} --version`; no nvcc images",
                n.display()
            ),
        }
    }
    let source = std::fs::read_to_string(&src).expect("read cuda/relayout.cu");
    let mut libs: Vec<String> = std::env::var("PDXFER_KERNEL_NVRTC")
        .unwrap_or_default()
        .split(':')
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect();
    let has_cuda12 = libs
        .iter()
        .any(|l| nvrtc::Nvrtc::open(l).is_ok_and(|n| n.version.0 == 12));
    let mut searched = Vec::new();
    if !has_cuda12 {
        match find_cuda12_nvrtc(&mut searched) {
            Some(l) => libs.push(l),
            None => searched.push("no libnvrtc.so.12 found".into()),
        }
    }
    for lib in &libs {
        println!("cargo:rerun-if-changed={lib}");
        let r = nvrtc::Nvrtc::open(lib).and_then(|nv| {
            let c = nv.compile(&source, "relayout.cu", &["--gpu-architecture=sm_90"])?;
            Ok((nv.version, c))
        });
        match r {
            Ok(((major, minor), c)) => {
                let (major, minor) = (major as u32, minor as u32);
                let tag = format!("cu{major}{minor}");
                let compiler = format!("NVRTC {major}.{minor}");
                if let Some(cubin) = c.cubin {
                    let f = out_dir.join(format!("relayout_sm90_{tag}_nvrtc.cubin"));
                    std::fs::write(&f, cubin).expect("write cubin");
                    images.push(Image {
                        kind: "Cubin",
                        toolkit: (major, minor),
                        compiler: compiler.clone(),
                        file: f,
                    });
                }
                let f = out_dir.join(format!("relayout_sm90_{tag}_nvrtc.ptx"));
                std::fs::write(&f, c.ptx).expect("write PTX");
                images.push(Image {
                    kind: "Ptx",
                    toolkit: (major, minor),
                    compiler,
                    file: f,
                });
            }
            Err(e) => println!("cargo:warning=NVRTC {lib}: {e}; its images are not embedded"),
        }
    }
    require_cuda12_cubin(&images, &searched);
    // newest toolkit first; one image per (kind, toolkit)
    images.sort_by(|a, b| b.toolkit.cmp(&a.toolkit).then(a.kind.cmp(b.kind)));
    images.dedup_by(|a, b| a.kind == b.kind && a.toolkit == b.toolkit);
    let list: String = images
        .iter()
        .map(|i| {
            format!(
                "    KernelImage {{ kind: ImageKind::{}, arch: \"sm_90\", toolkit: ({}, {}), compiler: {:?}, bytes: include_bytes!({:?}) }},\n",
                i.kind,
                i.toolkit.0,
                i.toolkit.1,
                i.compiler,
                i.file.display().to_string()
            )
        })
        .collect();
    let code = format!(
        "/// CUDA source of the relayout kernels (`cuda/relayout.cu`), for NVRTC.\n\
         pub const SOURCE: &str = include_str!({:?});\n\
         /// The images compiled at build time, newest toolkit first.\n\
         pub const IMAGES: &[KernelImage] = &[\n{list}];\n",
        src.display().to_string(),
    );
    std::fs::write(out_dir.join("kernels.rs"), code).expect("write kernels.rs");
}

/// The site-packages (and other `sys.path` entries) of the Python running
/// the build (`$PYO3_PYTHON`, which setuptools-rust sets, else `python3`):
/// inside pip's isolated build environment this is where the build
/// requirements are.
fn build_python_paths() -> Vec<PathBuf> {
    println!("cargo:rerun-if-env-changed=PYO3_PYTHON");
    let py = std::env::var("PYO3_PYTHON").unwrap_or_else(|_| "python3".into());
    let Ok(o) = Command::new(&py)
        .args([
            "-c",
            "import sys; print(chr(10).join(p for p in sys.path if p))",
        ])
        .output()
    else {
        return Vec::new();
    };
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(PathBuf::from)
        .filter(|p| p.is_dir())
        .collect()
}

/// The first CUDA 12 NVRTC found as pdxfer finds NVRTC at run time, plus the
/// build Python's `sys.path`; `searched` gets what was tried.
fn find_cuda12_nvrtc(searched: &mut Vec<String>) -> Option<String> {
    for var in ["PYTHONPATH", "VIRTUAL_ENV", "CONDA_PREFIX", "PDXFER_NVRTC"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    let mut dirs = build_python_paths();
    for d in library::site_packages() {
        if !dirs.contains(&d) {
            dirs.push(d);
        }
    }
    for c in library::NVRTC.candidates_in(&dirs) {
        match nvrtc::Nvrtc::open(&c) {
            Ok(n) if n.version.0 == 12 => return Some(c),
            Ok(n) => searched.push(format!("{c}: NVRTC {}.{}", n.version.0, n.version.1)),
            Err(e) => searched.push(e),
        }
    }
    None
}

/// Fails a release build whose images hold no CUDA 12 cubin (the image that
/// loads on every 12.x driver), unless `PDXFER_KERNELS_WITHOUT_CUDA12=1`.
fn require_cuda12_cubin(images: &[Image], searched: &[String]) {
    println!("cargo:rerun-if-env-changed=PDXFER_KERNELS_WITHOUT_CUDA12");
    if images
        .iter()
        .any(|i| i.kind == "Cubin" && i.toolkit.0 == 12)
    {
        return;
    }
    let why = format!(
        "no CUDA 12 cubin of the relayout kernels is embedded: hosts with a CUDA 12.x driver would need NVRTC at run time. Install one (pip install nvidia-cuda-nvrtc-cu12==12.4.127, or `eval \"$(bash scripts/cuda-deps.sh)\"`) or name its libnvrtc.so.12 in PDXFER_KERNEL_NVRTC. Searched: {}",
        searched.join("; ")
    );
    let release = std::env::var("PROFILE").as_deref() == Ok("release");
    let accepted = std::env::var("PDXFER_KERNELS_WITHOUT_CUDA12").as_deref() == Ok("1");
    if release && !accepted {
        panic!("{why}; PDXFER_KERNELS_WITHOUT_CUDA12=1 builds without it");
    }
    println!("cargo:warning={why}");
}
