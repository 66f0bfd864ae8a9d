//! NCCL through cudarc, loaded at run time; absent library is [`Status::NoNccl`].

use crate::error::{Error, Result, Status};

/// NCCL version code (e.g. 23203 for 2.32.3), or a typed error.
pub fn probe() -> Result<i32> {
    #[cfg(feature = "nccl")]
    {
        // SAFETY: only tries to dlopen the library and reports the result.
        if !unsafe { cudarc::nccl::sys::is_culib_present() } {
            return Err(Error::new(
                Status::NoNccl,
                "libnccl.so could not be loaded (NCCL wheels ship libnccl.so.2 only: link it as libnccl.so on LD_LIBRARY_PATH)",
            ));
        }
        match std::panic::catch_unwind(cudarc::nccl::result::get_nccl_version) {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(Error::new(
                Status::Nccl,
                format!("ncclGetVersion failed: {:?}", e.0),
            )),
            Err(_) => Err(Error::new(
                Status::NoNccl,
                "libnccl is missing a required symbol",
            )),
        }
    }
    #[cfg(not(feature = "nccl"))]
    {
        Err(Error::new(
            Status::Unsupported,
            "built without the `nccl` feature",
        ))
    }
}
