//! The `libraries` and `kernel_images` parts of `pdxfer info`: which of the
//! libraries pdxfer opens at run time (libibverbs, libcuda, NVRTC, libnccl)
//! were found, where and in which version, or why not; and which kernel
//! images the library embeds.

use serde_json::{json, Value};

fn missing(e: &pdxfer::Error) -> Value {
    json!({"found": false, "kind": e.kind(), "code": e.status() as i32, "detail": e.detail()})
}

/// libibverbs: the file and its rdma-core release, or why it did not load.
fn libibverbs() -> Value {
    #[cfg(feature = "rdma")]
    {
        match pdxfer::transport::rdma::verbs_sys::verbs() {
            Ok(v) => json!({
                "found": true,
                "path": v.file.clone().unwrap_or_else(|| v.name.clone()),
                "version": v.rdma_core_release().map(|r| format!("rdma-core {r}")),
            }),
            Err(e) => missing(&e),
        }
    }
    #[cfg(not(feature = "rdma"))]
    {
        json!({"found": false, "detail": "built without the `rdma` feature"})
    }
}

/// libcuda: the file and the driver's CUDA version, or why not.
fn libcuda() -> Value {
    match pdxfer::cuda::probe() {
        Ok(i) => json!({
            "found": true,
            "path": pdxfer::cuda::loaded::file_of_library(&["libcuda.so.1", "libcuda.so"], c"cuInit").ok(),
            "version": format!("CUDA {}", pdxfer::cuda::version_text(i.driver_version)),
        }),
        Err(e) => missing(&e),
    }
}

/// Every NVRTC found (newest first), or why none.
fn nvrtc() -> Value {
    let found = pdxfer::relayout::gpu::nvrtc_libraries();
    if found.is_empty() {
        return match pdxfer::relayout::gpu::probe_nvrtc() {
            Err(e) => missing(&e),
            Ok(_) => json!({"found": false}),
        };
    }
    let list: Vec<Value> = found
        .iter()
        .map(|(path, (major, minor))| json!({"path": path, "version": format!("{major}.{minor}")}))
        .collect();
    json!({"found": true, "path": list[0]["path"], "version": list[0]["version"], "all": list})
}

/// libnccl: the file and its version, or why not.
fn libnccl() -> Value {
    match pdxfer::transport::nccl::probe() {
        Ok((v, path)) => json!({
            "found": true,
            "path": path,
            "version": format!("{}.{}.{}", v / 10000, v / 100 % 100, v % 100),
        }),
        Err(e) => missing(&e),
    }
}

/// The `libraries` object of `pdxfer info --json`.
pub fn libraries() -> Value {
    json!({
        "libibverbs": libibverbs(),
        "libcuda": libcuda(),
        "nvrtc": nvrtc(),
        "libnccl": libnccl(),
    })
}

/// The embedded kernel images: kind, architecture, CUDA version, compiler.
pub fn kernel_images() -> Value {
    use pdxfer::relayout::gpu::kernels::{ImageKind, IMAGES};
    IMAGES
        .iter()
        .map(|i| {
            json!({
                "kind": match i.kind { ImageKind::Cubin => "cubin", ImageKind::Ptx => "ptx" },
                "arch": i.arch,
                "cuda": format!("{}.{}", i.toolkit.0, i.toolkit.1),
                "compiler": i.compiler,
                "bytes": i.bytes.len(),
            })
        })
        .collect()
}

/// The text lines of `pdxfer info` for `libraries` and `kernel_images`.
pub fn print(libs: &Value, images: &Value) {
    println!("  libraries");
    for k in ["libibverbs", "libcuda", "nvrtc", "libnccl"] {
        let l = &libs[k];
        if l["found"].as_bool() == Some(true) {
            let version = l["version"].as_str().unwrap_or("?");
            let path = l["path"].as_str().unwrap_or("?");
            println!("    {k:<10} yes  {version}  {path}");
            for other in l["all"].as_array().into_iter().flatten().skip(1) {
                println!(
                    "    {:<10}      {}  {}",
                    "",
                    other["version"].as_str().unwrap_or("?"),
                    other["path"].as_str().unwrap_or("?")
                );
            }
        } else {
            println!("    {k:<10} no   {}", l["detail"].as_str().unwrap_or(""));
        }
    }
    let list = images.as_array().cloned().unwrap_or_default();
    if list.is_empty() {
        println!("  kernel images: none embedded (NVRTC at run time only)");
    }
    for i in list {
        println!(
            "  kernel image  {} {} CUDA {} ({})",
            i["arch"].as_str().unwrap_or("?"),
            i["kind"].as_str().unwrap_or("?"),
            i["cuda"].as_str().unwrap_or("?"),
            i["compiler"].as_str().unwrap_or("?")
        );
    }
}
