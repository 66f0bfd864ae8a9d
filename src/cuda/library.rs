//! Finding a CUDA user-space library (NVRTC, NCCL) by its sonames and in
//! pip's site-packages, without symlinks or loader-path setup.
//!
//! cudarc's dynamic loading tries a fixed list of names (`libnvrtc.so`,
//! `.so.12`, ...; `libnccl.so`, ...), never `libnvrtc.so.13` nor
//! `libnccl.so.2`, and never a wheel's directory. Here the candidates are, in
//! order: the file (or directory) named by the library's environment variable,
//! each soname on the loader path, then each soname inside each wheel
//! directory of every site-packages found: `$PYTHONPATH` entries (a
//! `pip install --target` directory too), `$VIRTUAL_ENV`, `$CONDA_PREFIX`,
//! the prefix of the running executable when it is a Python (pdxfer loaded by
//! ctypes), the prefix of each `python3` on `PATH`, the user site and the
//! system dist-packages. Errors list every path tried.

use std::path::{Path, PathBuf};

/// A library to look for.
#[derive(Debug, Clone, Copy)]
pub struct CudaLibrary {
    /// Name in messages ("NVRTC").
    pub what: &'static str,
    /// Environment variable naming the file, or a directory holding it.
    pub env: &'static str,
    /// File names, preferred first.
    pub sonames: &'static [&'static str],
    /// Directories inside site-packages where the pip wheels put it.
    pub pip_dirs: &'static [&'static str],
    /// The pip wheels that provide it (for messages).
    pub wheels: &'static str,
}

/// NVRTC of CUDA 13 and 12 (`nvidia-cuda-nvrtc` puts `libnvrtc.so.13` in
/// `nvidia/cu13/lib`, `nvidia-cuda-nvrtc-cu12` puts `libnvrtc.so.12` in
/// `nvidia/cuda_nvrtc/lib`).
pub const NVRTC: CudaLibrary = CudaLibrary {
    what: "NVRTC",
    env: "PDXFER_NVRTC",
    sonames: &["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"],
    pip_dirs: &["nvidia/cu13/lib", "nvidia/cuda_nvrtc/lib"],
    wheels: "nvidia-cuda-nvrtc or nvidia-cuda-nvrtc-cu12",
};

/// NCCL 2.x (`nvidia-nccl-cu12`/`-cu13` put `libnccl.so.2` in `nvidia/nccl/lib`).
pub const NCCL: CudaLibrary = CudaLibrary {
    what: "NCCL",
    env: "PDXFER_NCCL",
    sonames: &["libnccl.so.2", "libnccl.so"],
    pip_dirs: &["nvidia/nccl/lib", "nvidia/cu13/lib"],
    wheels: "nvidia-nccl-cu12 or nvidia-nccl-cu13",
};

/// The site-packages directories of the Pythons this process can see, each once.
pub fn site_packages() -> Vec<PathBuf> {
    let mut roots: Vec<PathBuf> = Vec::new();
    if let Some(pp) = std::env::var_os("PYTHONPATH") {
        roots.extend(std::env::split_paths(&pp).filter(|p| !p.as_os_str().is_empty()));
    }
    let mut prefixes: Vec<PathBuf> = Vec::new();
    for var in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Some(p) = std::env::var_os(var).filter(|p| !p.is_empty()) {
            prefixes.push(PathBuf::from(p));
        }
    }
    let python_prefix = |exe: &Path| -> Option<PathBuf> {
        let name = exe.file_name()?.to_str()?;
        if !name.starts_with("python") {
            return None;
        }
        Some(exe.parent()?.parent()?.to_path_buf())
    };
    if let Ok(exe) = std::env::current_exe() {
        prefixes.extend(python_prefix(&exe));
    }
    if let Some(path) = std::env::var_os("PATH") {
        for d in std::env::split_paths(&path) {
            let py = d.join("python3");
            if py.is_file() {
                prefixes.extend(python_prefix(&py));
            }
        }
    }
    if let Some(home) = std::env::var_os("HOME") {
        prefixes.push(PathBuf::from(home).join(".local"));
    }
    prefixes.push(PathBuf::from("/usr/local"));
    prefixes.push(PathBuf::from("/usr"));
    for pre in prefixes {
        let lib = pre.join("lib");
        let Ok(rd) = std::fs::read_dir(&lib) else {
            continue;
        };
        let mut pys: Vec<PathBuf> = rd
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("python3"))
            })
            .collect();
        pys.sort();
        for py in pys.into_iter().rev() {
            roots.push(py.join("site-packages"));
            roots.push(py.join("dist-packages"));
        }
    }
    let mut out: Vec<PathBuf> = Vec::new();
    for r in roots {
        if r.is_dir() && !out.contains(&r) {
            out.push(r);
        }
    }
    out
}

impl CudaLibrary {
    /// Every name or path to try, in order (see the module docs); paths
    /// inside site-packages only where the file exists.
    pub fn candidates(&self) -> Vec<String> {
        self.candidates_in(&site_packages())
    }

    /// [`candidates`](Self::candidates) with these site-packages directories.
    pub(crate) fn candidates_in(&self, site: &[PathBuf]) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        if let Some(p) = std::env::var_os(self.env).filter(|p| !p.is_empty()) {
            let p = PathBuf::from(p);
            if p.is_dir() {
                out.extend(
                    self.sonames
                        .iter()
                        .map(|s| p.join(s))
                        .filter(|f| f.exists())
                        .map(|f| f.display().to_string()),
                );
            } else {
                out.push(p.display().to_string());
            }
        }
        out.extend(self.sonames.iter().map(|s| s.to_string()));
        for sp in site {
            for d in self.pip_dirs {
                for s in self.sonames {
                    let f = sp.join(d).join(s);
                    if f.is_file() {
                        let f = f.display().to_string();
                        if !out.contains(&f) {
                            out.push(f);
                        }
                    }
                }
            }
        }
        out
    }

    /// Where a wheel's copy would be looked for (for messages): each
    /// site-packages joined with each wheel directory.
    pub fn searched_dirs(&self) -> Vec<String> {
        site_packages()
            .iter()
            .flat_map(|sp| self.pip_dirs.iter().map(move |d| sp.join(d)))
            .map(|p| p.display().to_string())
            .collect()
    }

    /// The text of a "not found" error: what was tried and why each failed.
    pub fn not_found(&self, tried: &[String]) -> String {
        let dirs = self.searched_dirs();
        format!(
            "{} could not be loaded; tried: {}{}. Install the pip wheel ({}), put its lib/ on LD_LIBRARY_PATH, or set {} to the library file",
            self.what,
            tried.join("; "),
            if dirs.is_empty() {
                " (no site-packages found)".to_string()
            } else {
                format!(" (site-packages directories searched: {})", dirs.join(", "))
            },
            self.wheels,
            self.env
        )
    }

    /// Opens the first candidate that loads (`RTLD_NOW | RTLD_GLOBAL`, so a
    /// later `dlopen` of the same soname gets this copy) and returns the name
    /// or path it loaded from; the error lists every candidate and its
    /// `dlerror`. The library stays loaded for the life of the process.
    pub fn open_first(&self) -> Result<String, String> {
        self.open_first_of(self.candidates())
    }

    fn open_first_of(&self, candidates: Vec<String>) -> Result<String, String> {
        let mut tried = Vec::new();
        for c in candidates {
            let Ok(name) = std::ffi::CString::new(c.as_str()) else {
                continue;
            };
            // SAFETY: dlopen of a shared library; the handle is kept (never closed).
            let h = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
            if !h.is_null() {
                return Ok(c);
            }
            // SAFETY: dlerror returns a thread-local message or null.
            let e = unsafe { libc::dlerror() };
            let why = if e.is_null() {
                "not loadable".to_string()
            } else {
                // SAFETY: non-null dlerror results are NUL-terminated.
                unsafe { std::ffi::CStr::from_ptr(e) }
                    .to_string_lossy()
                    .into_owned()
            };
            tried.push(why);
        }
        Err(self.not_found(&tried))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candidates_put_sonames_before_wheel_paths() {
        let c = NVRTC.candidates();
        assert_eq!(
            &c[..3],
            &["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"][..],
            "{c:?}"
        );
        for f in &c[3..] {
            assert!(
                f.contains("/nvidia/cu13/lib/") || f.contains("/nvidia/cuda_nvrtc/lib/"),
                "{f}"
            );
            assert!(Path::new(f).is_file(), "{f}");
        }
    }

    #[test]
    fn a_wheel_directory_in_site_packages_is_searched() {
        // a fake wheel tree: site-packages/nvidia/nccl/lib/libnccl.so.2
        let root = std::env::temp_dir().join(format!("pdxfer-sp-{}", std::process::id()));
        let lib = root.join("nvidia/nccl/lib");
        std::fs::create_dir_all(&lib).unwrap();
        std::fs::write(lib.join("libnccl.so.2"), b"not an ELF").unwrap();
        let spec = CudaLibrary {
            what: "NCCL",
            env: "PDXFER_TEST_LIBRARY_UNSET",
            sonames: &["libnccl.so.2"],
            pip_dirs: &["nvidia/nccl/lib"],
            wheels: "nvidia-nccl-cu12",
        };
        let c = spec.candidates_in(std::slice::from_ref(&root));
        let e = spec.open_first_of(c.clone()).unwrap_err();
        let want = lib.join("libnccl.so.2").display().to_string();
        assert!(c.contains(&want), "{c:?}");
        // the file is not a library: the error names the path and why
        assert!(e.contains(&want), "{e}");
        assert!(e.contains("NCCL could not be loaded"), "{e}");
        std::fs::remove_dir_all(&root).unwrap();
    }
}
