//! The relayout on CUDA devices: the kernels (`cuda/relayout.cu`), how
//! their module is found and loaded, and [`GpuRelayout`], which launches them.
//! The driver itself (contexts, streams, events, buffers, pointer checks,
//! library loading) is the [`cuda`](crate::cuda) layer below.
//!
//! As there, no call panics: a machine without a GPU gets
//! [`Status::NoCudaDriver`], a failing driver call [`Status::Cuda`], and
//! NVRTC trouble [`Status::Nvrtc`].
//!
//! [`GpuRelayout`] owns a [`GpuStream`](crate::cuda::GpuStream) (its
//! [`stream`](GpuRelayout::stream): allocations, copies, events), the kernel
//! module and the device tables of a launch. Kernels come from, in order: a
//! module file named by `$PDXFER_KERNEL_MODULE` (cubin or PTX, e.g. built on
//! the GPU host by `scripts/gpu-check.sh`), the images embedded at build time
//! that the driver can load ([`kernels::plan`]: sm_90 cubins of a toolkit
//! major the driver has, when the device is sm_90, newest first; then PTX no
//! newer than the driver), and finally NVRTC on the embedded source for the
//! device's own architecture ([`library::NVRTC`]: CUDA 13 or 12 sonames, pip
//! site-packages): a cubin from the newest NVRTC whose CUDA major the driver
//! runs (any 12.x NVRTC on a 12.x driver: minor-version compatibility), else
//! PTX from the newest NVRTC no newer than the driver.
//! [`GpuRelayout::kernel_origin`] says which loaded.
//!
//! Launches never block the calling thread on the stream: each returns a
//! [`GpuEvent`](crate::cuda::GpuEvent) recorded after the kernel, which a
//! sender polls or waits on. [`GpuRelayout::gather_sliced`] overlaps the
//! gather of slice `i+1` with the transfer of slice `i` through two halves of
//! a staging buffer.

use crate::cuda::{library, version_text};
use crate::error::{Error, Result, Status};

/// Kernel images embedded at build time (see `build.rs`), and which of them
/// a driver can load.
pub mod kernels {
    use crate::cuda::version_text;
    use serde::Serialize;

    /// What an embedded image is.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
    pub enum ImageKind {
        /// Machine code (SASS) for one architecture.
        Cubin,
        /// PTX, compiled by the driver's JIT for the device at load time.
        Ptx,
    }

    /// One kernel image compiled at build time.
    #[derive(Debug, Clone, Copy)]
    pub struct KernelImage {
        /// Cubin or PTX.
        pub kind: ImageKind,
        /// Target architecture (`sm_90`).
        pub arch: &'static str,
        /// CUDA toolkit `(major, minor)` of the compiler.
        pub toolkit: (u32, u32),
        /// The compiler ("nvcc 13.5 ...", "NVRTC 12.4 (path)").
        pub compiler: &'static str,
        /// The image (PTX text or ELF cubin).
        pub bytes: &'static [u8],
    }

    impl KernelImage {
        /// The oldest driver (`cuDriverGetVersion`, e.g. 12040 for 12.4) that
        /// loads it: a cubin needs a driver of its toolkit's major version
        /// (minor-version compatibility: a 12.x cubin loads on any 12.x
        /// driver, a 13.x cubin needs a 13.x driver, >= 580), PTX a driver at
        /// least as new as its toolkit (the JIT knows PTX ISAs up to its own).
        pub fn min_driver(&self) -> i32 {
            let (major, minor) = (self.toolkit.0 as i32, self.toolkit.1 as i32);
            match self.kind {
                ImageKind::Cubin => major * 1000,
                ImageKind::Ptx => major * 1000 + minor * 10,
            }
        }

        /// "sm_90 cubin, CUDA 12.4 (NVRTC 12.4 ...)".
        pub fn describe(&self) -> String {
            let kind = match self.kind {
                ImageKind::Cubin => "cubin",
                ImageKind::Ptx => "PTX",
            };
            format!(
                "embedded {} {kind}, CUDA {}.{} ({})",
                self.arch, self.toolkit.0, self.toolkit.1, self.compiler
            )
        }
    }

    /// The images of `images` that driver `driver` can load on a device of
    /// compute capability `cc`, in the order to try them (sm_90 cubins only
    /// on cc 9.0, newest toolkit first; then PTX for cc >= 9.0, newest
    /// first), and a line for each image left out saying why.
    pub fn plan(
        images: &[KernelImage],
        driver: i32,
        cc: (i32, i32),
    ) -> (Vec<&KernelImage>, Vec<String>) {
        let mut order: Vec<&KernelImage> = images.iter().collect();
        order.sort_by(|a, b| {
            (a.kind != ImageKind::Cubin)
                .cmp(&(b.kind != ImageKind::Cubin))
                .then(b.toolkit.cmp(&a.toolkit))
        });
        let mut take = Vec::new();
        let mut skipped = Vec::new();
        for i in order {
            let fits = match i.kind {
                ImageKind::Cubin => cc == (9, 0),
                ImageKind::Ptx => cc.0 >= 9,
            };
            if !fits {
                skipped.push(format!(
                    "{}: not for a compute capability {}.{} device",
                    i.describe(),
                    cc.0,
                    cc.1
                ));
            } else if driver < i.min_driver() {
                skipped.push(format!(
                    "{}: needs driver CUDA >= {}, the driver is CUDA {}",
                    i.describe(),
                    version_text(i.min_driver()),
                    version_text(driver)
                ));
            } else {
                take.push(i);
            }
        }
        (take, skipped)
    }

    include!(concat!(env!("OUT_DIR"), "/kernels.rs"));
}

#[cfg(feature = "cuda")]
pub mod check;
#[cfg(feature = "cuda")]
mod launch;
pub mod nvrtc;
#[cfg(feature = "cuda")]
pub use launch::{GatherSlice, GpuRelayout, HostSlice, KernelOrigin, PreparedCopy};

/// The NVRTC libraries this process can load, newest first, each once per
/// version, and what was tried without success (opened once per process).
fn nvrtcs() -> &'static (Vec<nvrtc::Nvrtc>, Vec<String>) {
    static FOUND: std::sync::OnceLock<(Vec<nvrtc::Nvrtc>, Vec<String>)> =
        std::sync::OnceLock::new();
    FOUND.get_or_init(|| {
        let mut found: Vec<nvrtc::Nvrtc> = Vec::new();
        let mut failed = Vec::new();
        for c in library::NVRTC.candidates() {
            match nvrtc::Nvrtc::open(&c) {
                Ok(n) if found.iter().any(|f| f.version == n.version) => {}
                Ok(n) => found.push(n),
                Err(e) => failed.push(e),
            }
        }
        found.sort_by_key(|n| std::cmp::Reverse(n.version));
        (found, failed)
    })
}

/// The error for no loadable NVRTC, listing what was tried.
fn no_nvrtc() -> Error {
    Error::new(Status::Nvrtc, library::NVRTC.not_found(&nvrtcs().1))
}

/// The newest NVRTC no newer than driver `driver` (any when `None`), or why none.
fn pick_nvrtc(driver: Option<i32>) -> Result<&'static nvrtc::Nvrtc> {
    let (found, _) = nvrtcs();
    if found.is_empty() {
        return Err(no_nvrtc());
    }
    let v = |n: &nvrtc::Nvrtc| n.version.0 * 1000 + n.version.1 * 10;
    match driver {
        None => Ok(&found[0]),
        Some(d) => found.iter().find(|n| v(n) <= d).ok_or_else(|| {
            let have: Vec<String> = found
                .iter()
                .map(|n| format!("NVRTC {}.{} ({})", n.version.0, n.version.1, n.path))
                .collect();
            Error::new(
                Status::Nvrtc,
                format!(
                    "every NVRTC found is newer than the driver (CUDA {}), so its PTX would not load: {}",
                    version_text(d),
                    have.join(", ")
                ),
            )
        }),
    }
}

/// The index in `versions` (NVRTC `(major, minor)`, newest first) of the
/// NVRTC whose cubin driver `driver` loads: the newest of a CUDA major no
/// newer than the driver's (a cubin loads on any driver of its major or later).
fn cubin_nvrtc_index(versions: &[(i32, i32)], driver: i32) -> Option<usize> {
    versions.iter().position(|v| v.0 * 1000 <= driver)
}

/// Compiles the embedded source with `nv` for `arch`; returns the PTX.
fn compile_with(nv: &nvrtc::Nvrtc, arch: &str) -> Result<String> {
    compile_both(nv, arch).map(|c| c.ptx)
}

/// Compiles the embedded source with `nv` for `arch`: PTX and, for a real
/// architecture, the cubin.
fn compile_both(nv: &nvrtc::Nvrtc, arch: &str) -> Result<nvrtc::Compiled> {
    nv.compile(
        kernels::SOURCE,
        "relayout.cu",
        &[&format!("--gpu-architecture={arch}")],
    )
    .map_err(|e| {
        Error::new(
            Status::Nvrtc,
            format!(
                "NVRTC {}.{} ({}) could not compile cuda/relayout.cu for {arch}: {e}",
                nv.version.0, nv.version.1, nv.path
            ),
        )
    })
}

/// Probes NVRTC (run-time kernel compilation): every version found, newest
/// first ("NVRTC 13.5 (libnvrtc.so.13), NVRTC 12.4 (/path/...)"), or why none.
pub fn probe_nvrtc() -> Result<String> {
    let (found, _) = nvrtcs();
    if found.is_empty() {
        return Err(no_nvrtc());
    }
    Ok(found
        .iter()
        .map(|n| format!("NVRTC {}.{} ({})", n.version.0, n.version.1, n.path))
        .collect::<Vec<_>>()
        .join(", "))
}

/// Every NVRTC found, newest first: what was passed to `dlopen` (a soname
/// or a full path) and its `(major, minor)`.
pub fn nvrtc_libraries() -> Vec<(String, (i32, i32))> {
    nvrtcs()
        .0
        .iter()
        .map(|n| (n.path.clone(), n.version))
        .collect()
}

/// Compiles the embedded kernel source with the newest NVRTC found for
/// `arch` (e.g. `sm_90`) and returns the PTX. Needs libnvrtc only, no GPU.
pub fn nvrtc_compile(arch: &str) -> Result<String> {
    compile_with(pick_nvrtc(None)?, arch)
}

/// Compiles the embedded source for `arch` with the newest NVRTC whose PTX
/// driver `driver` loads; returns the PTX and that NVRTC's description.
pub fn nvrtc_compile_for_driver(arch: &str, driver: i32) -> Result<(String, String)> {
    let nv = pick_nvrtc(Some(driver))?;
    let ptx = compile_with(nv, arch)?;
    Ok((
        ptx,
        format!("NVRTC {}.{} ({})", nv.version.0, nv.version.1, nv.path),
    ))
}

/// Compiles the embedded source for `arch` (`sm_90`) to a cubin with the
/// newest NVRTC whose CUDA major driver `driver` runs; returns the cubin and
/// that NVRTC's description, or why there is none.
pub fn nvrtc_cubin_for_driver(arch: &str, driver: i32) -> Result<(Vec<u8>, String)> {
    let (found, _) = nvrtcs();
    if found.is_empty() {
        return Err(no_nvrtc());
    }
    cubin_from(found, arch, driver)
}

/// [`nvrtc_cubin_for_driver`] with the NVRTCs `found` (newest first).
fn cubin_from(found: &[nvrtc::Nvrtc], arch: &str, driver: i32) -> Result<(Vec<u8>, String)> {
    let versions: Vec<(i32, i32)> = found.iter().map(|n| n.version).collect();
    let Some(i) = cubin_nvrtc_index(&versions, driver) else {
        return Err(Error::new(
            Status::Nvrtc,
            format!(
                "every NVRTC found is of a newer CUDA major than the driver (CUDA {}), so its cubin would not load: {}",
                version_text(driver),
                found
                    .iter()
                    .map(|n| format!("NVRTC {}.{} ({})", n.version.0, n.version.1, n.path))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        ));
    };
    let nv = &found[i];
    let what = format!("NVRTC {}.{} ({})", nv.version.0, nv.version.1, nv.path);
    let cubin = compile_both(nv, arch)?.cubin.ok_or_else(|| {
        Error::new(
            Status::Nvrtc,
            format!("{what} made no cubin for {arch} (it lacks nvrtcGetCUBIN, before CUDA 11.1)"),
        )
    })?;
    Ok((cubin, what))
}

/// Opens device `ordinal` with its kernels and says which image loaded and
/// on which driver ("embedded sm_90 cubin, CUDA 12.4 (...) on driver CUDA
/// 12.4"), or why none did (the error lists every image tried).
pub fn probe_kernels(ordinal: usize) -> Result<String> {
    #[cfg(feature = "cuda")]
    {
        let g = GpuRelayout::new(ordinal)?;
        Ok(format!(
            "{} on driver CUDA {}",
            g.kernel_origin(),
            version_text(g.driver_version())
        ))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = ordinal;
        Err(Error::new(
            Status::Unsupported,
            "built without the `cuda` feature",
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_source_is_the_kernel_file() {
        assert!(kernels::SOURCE.contains("extern \"C\" __global__"));
        assert!(kernels::SOURCE.contains("pdx_gather"));
        assert!(kernels::SOURCE.contains("pdx_scatter"));
        for i in kernels::IMAGES {
            match i.kind {
                kernels::ImageKind::Ptx => {
                    let ptx = std::str::from_utf8(i.bytes).expect("PTX is text");
                    assert!(ptx.contains(".target sm_90"), "{}", i.describe());
                    assert!(ptx.contains("pdx_gather") && ptx.contains("pdx_scatter"));
                    // PTX ISA 9.x comes from CUDA 13.x, 8.x from 12.x
                    let isa = format!(".version {}.", i.toolkit.0 - 4);
                    assert!(ptx.contains(&isa), "{}: no {isa}", i.describe());
                }
                kernels::ImageKind::Cubin => {
                    assert_eq!(&i.bytes[..4], b"\x7fELF", "{}", i.describe());
                    // CUDA 13 cubins use a new ELF OS/ABI (0x41), 12.x ones 0x33
                    let abi = if i.toolkit.0 >= 13 { 0x41 } else { 0x33 };
                    assert_eq!(i.bytes[7], abi, "{}", i.describe());
                }
            }
        }
        // CI embeds images for both driver lines (scripts/cuda-deps.sh)
        if std::env::var_os("PDXFER_REQUIRE_CUDA_TOOLS").is_some() {
            for major in [12, 13] {
                for kind in [kernels::ImageKind::Cubin, kernels::ImageKind::Ptx] {
                    assert!(
                        kernels::IMAGES
                            .iter()
                            .any(|i| i.kind == kind && i.toolkit.0 == major),
                        "no CUDA {major} {kind:?} embedded"
                    );
                }
            }
        }
    }

    fn image(kind: kernels::ImageKind, toolkit: (u32, u32)) -> kernels::KernelImage {
        kernels::KernelImage {
            kind,
            arch: "sm_90",
            toolkit,
            compiler: "test",
            bytes: b"",
        }
    }

    #[test]
    fn the_plan_takes_what_the_driver_loads() {
        use kernels::ImageKind::{Cubin, Ptx};
        let imgs = [
            image(Ptx, (12, 4)),
            image(Cubin, (13, 5)),
            image(Ptx, (13, 5)),
            image(Cubin, (12, 4)),
        ];
        let order = |driver, cc| {
            kernels::plan(&imgs, driver, cc)
                .0
                .iter()
                .map(|i| (i.kind, i.toolkit))
                .collect::<Vec<_>>()
        };
        // a 12.4 driver: the 12.x images only, cubin first
        assert_eq!(order(12040, (9, 0)), [(Cubin, (12, 4)), (Ptx, (12, 4))]);
        // 12.2: the 12.4 cubin (minor-version compatibility), not its PTX
        assert_eq!(order(12020, (9, 0)), [(Cubin, (12, 4))]);
        // 13.0: both cubins, newest first; the 13.5 PTX is too new for its JIT
        assert_eq!(
            order(13000, (9, 0)),
            [(Cubin, (13, 5)), (Cubin, (12, 4)), (Ptx, (12, 4))]
        );
        assert_eq!(order(13050, (9, 0))[0], (Cubin, (13, 5)));
        assert_eq!(order(13050, (9, 0)).len(), 4);
        // a newer architecture: PTX only
        assert_eq!(order(13050, (10, 0)), [(Ptx, (13, 5)), (Ptx, (12, 4))]);
        // too old for all: every image is left out, each saying why
        let (take, why) = kernels::plan(&imgs, 11080, (9, 0));
        assert!(take.is_empty());
        assert_eq!(why.len(), 4);
        assert!(
            why.iter().any(|w| w.contains("CUDA 13.5")
                && w.contains("needs driver CUDA >= 13.0")
                && w.contains("the driver is CUDA 11.8")),
            "{why:?}"
        );
    }

    /// NVRTC compiles the embedded source when libnvrtc is loadable, and says
    /// why not otherwise. `PDXFER_REQUIRE_CUDA_TOOLS=1` (the CI test command,
    /// after `scripts/cuda-deps.sh`) turns a missing NVRTC into a failure.
    #[test]
    fn nvrtc_compiles_the_embedded_source() {
        match nvrtc_compile("sm_90") {
            Ok(ptx) => {
                assert!(
                    ptx.contains(".target sm_90"),
                    "{}",
                    &ptx[..ptx.len().min(400)]
                );
                assert!(ptx.contains(".entry pdx_gather"));
                assert!(ptx.contains(".entry pdx_scatter"));
            }
            Err(e) => {
                assert!(
                    matches!(e.status(), Status::Nvrtc | Status::Unsupported),
                    "{e}"
                );
                assert!(
                    std::env::var_os("PDXFER_REQUIRE_CUDA_TOOLS").is_none(),
                    "PDXFER_REQUIRE_CUDA_TOOLS is set but NVRTC is unusable: {e}"
                );
                crate::test_skip::skip("cuda-tools", &e.to_string());
            }
        }
    }

    /// The CUDA 12 NVRTC wheel that `scripts/cuda-deps.sh` installs (its
    /// path is `$PDXFER_KERNEL_NVRTC`) is found inside its site-packages
    /// tree with no symlink and no loader path, loads, and compiles the
    /// kernels to CUDA 12 images (PTX ISA 8.x, a 12.x cubin).
    #[test]
    fn the_cuda12_wheel_is_found_in_its_site_packages() {
        let Some(lib) = std::env::var_os("PDXFER_KERNEL_NVRTC") else {
            assert!(
                std::env::var_os("PDXFER_REQUIRE_CUDA_TOOLS").is_none(),
                "PDXFER_REQUIRE_CUDA_TOOLS is set but PDXFER_KERNEL_NVRTC is not"
            );
            crate::test_skip::skip(
                "cuda-tools",
                "no PDXFER_KERNEL_NVRTC (scripts/cuda-deps.sh)",
            );
            return;
        };
        let lib = std::path::PathBuf::from(lib);
        // <site-packages>/nvidia/cuda_nvrtc/lib/libnvrtc.so.12
        let site = lib.ancestors().nth(4).unwrap().to_path_buf();
        let c = library::NVRTC.candidates_in(std::slice::from_ref(&site));
        let want = lib.display().to_string();
        assert!(c.contains(&want), "{c:?}");
        let nv = nvrtc::Nvrtc::open(&want).unwrap();
        assert_eq!(nv.version.0, 12, "{nv:?}");
        let out = nv
            .compile(
                kernels::SOURCE,
                "relayout.cu",
                &["--gpu-architecture=sm_90"],
            )
            .unwrap();
        assert!(out.ptx.contains(".version 8."), "not PTX ISA 8.x");
        let cubin = out.cubin.expect("a cubin for sm_90");
        assert_eq!((&cubin[..4], cubin[7]), (&b"\x7fELF"[..], 0x33));
        // a bad option is a typed error carrying NVRTC's log
        let e = nv
            .compile(kernels::SOURCE, "relayout.cu", &["--no-such-option"])
            .err()
            .expect("refused");
        assert!(e.contains("nvrtcCompileProgram"), "{e}");
    }

    #[test]
    fn the_cubin_nvrtc_is_the_newest_of_a_major_the_driver_runs() {
        let v = [(13, 5), (12, 9), (12, 4)];
        // a 12.2 driver runs a 12.9 cubin (minor-version compatibility)
        assert_eq!(cubin_nvrtc_index(&v, 12020), Some(1));
        assert_eq!(cubin_nvrtc_index(&v, 13000), Some(0));
        assert_eq!(cubin_nvrtc_index(&v, 11080), None);
        assert_eq!(cubin_nvrtc_index(&[(12, 4)], 13050), Some(0));
    }

    /// With the CUDA 12.4 NVRTC of `scripts/cuda-deps.sh`
    /// (`$PDXFER_KERNEL_NVRTC`) beside the newest NVRTC found, the fallback
    /// compiles a 12.x cubin for a 12.x driver and, where a 13.x NVRTC is
    /// there too, a 13.x cubin for a 13.x driver.
    #[test]
    fn the_run_time_fallback_compiles_a_cubin_of_the_drivers_major() {
        let Some(lib) = std::env::var_os("PDXFER_KERNEL_NVRTC") else {
            assert!(
                std::env::var_os("PDXFER_REQUIRE_CUDA_TOOLS").is_none(),
                "PDXFER_REQUIRE_CUDA_TOOLS is set but PDXFER_KERNEL_NVRTC is not"
            );
            crate::test_skip::skip(
                "cuda-tools",
                "no PDXFER_KERNEL_NVRTC (scripts/cuda-deps.sh)",
            );
            return;
        };
        let cu12 = nvrtc::Nvrtc::open(&lib.to_string_lossy()).unwrap();
        assert_eq!(cu12.version.0, 12, "{cu12:?}");
        let mut found = vec![cu12];
        if let Some(n) = nvrtcs().0.iter().find(|n| n.version.0 >= 13) {
            found.insert(0, nvrtc::Nvrtc::open(&n.path).unwrap());
        }
        let (cubin, what) = cubin_from(&found, "sm_90", 12020).unwrap();
        assert!(what.starts_with("NVRTC 12."), "{what}");
        // an ELF cubin of CUDA 12 (OS/ABI 0x33)
        assert_eq!((&cubin[..4], cubin[7]), (&b"\x7fELF"[..], 0x33), "{what}");
        if found.len() == 2 {
            let (cubin, what) = cubin_from(&found, "sm_90", 13050).unwrap();
            assert!(what.starts_with("NVRTC 13."), "{what}");
            assert_eq!(cubin[7], 0x41, "{what}");
        }
        let e = cubin_from(&found, "sm_90", 11080).unwrap_err();
        assert_eq!(e.status(), Status::Nvrtc);
        assert!(e.detail().contains("CUDA 11.8"), "{e}");
    }

    /// `PDXFER_REQUIRE_CUDA_TOOLS=1` turns a missing NVRTC into a failure.
    #[test]
    fn nvrtc_is_picked_no_newer_than_the_driver() {
        if probe_nvrtc().is_err() {
            assert!(
                std::env::var_os("PDXFER_REQUIRE_CUDA_TOOLS").is_none(),
                "PDXFER_REQUIRE_CUDA_TOOLS is set but no NVRTC was found"
            );
            crate::test_skip::skip("cuda-tools", "no libnvrtc");
            return;
        }
        let newest = pick_nvrtc(None).unwrap();
        let v = newest.version.0 * 1000 + newest.version.1 * 10;
        assert_eq!(pick_nvrtc(Some(v)).unwrap().version, newest.version);
        // a driver older than every NVRTC: a typed error naming the versions
        let e = pick_nvrtc(Some(9000)).unwrap_err();
        assert_eq!(e.status(), Status::Nvrtc);
        assert!(e.detail().contains("CUDA 9.0"), "{e}");
        assert!(
            e.detail()
                .contains(&format!("NVRTC {}.{}", newest.version.0, newest.version.1)),
            "{e}"
        );
    }

    #[test]
    fn nvrtc_reports_bad_arch_as_typed_error() {
        if let Err(e) = probe_nvrtc() {
            assert!(
                std::env::var_os("PDXFER_REQUIRE_CUDA_TOOLS").is_none(),
                "PDXFER_REQUIRE_CUDA_TOOLS is set but NVRTC is unusable: {e}"
            );
            crate::test_skip::skip("cuda-tools", &format!("no libnvrtc: {e}"));
            return;
        }
        let e = nvrtc_compile("sm_1").unwrap_err();
        assert_eq!(e.status(), Status::Nvrtc, "{e}");
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn engine_types_move_between_threads() {
        fn send<T: Send>() {}
        send::<GpuRelayout>();
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn no_driver_is_typed_everywhere() {
        if !matches!(crate::cuda::probe(), Err(e) if e.status() == Status::NoCudaDriver) {
            crate::test_skip::skip("gpu-present", "a CUDA driver is present");
            return;
        }
        let e = GpuRelayout::new(0).unwrap_err();
        assert_eq!(e.status(), Status::NoCudaDriver, "{e}");
        // a second call still answers (cudarc's loader state is not poisoned)
        assert_eq!(
            GpuRelayout::new(0).unwrap_err().status(),
            Status::NoCudaDriver
        );
    }
}
