//! NVRTC (run-time CUDA C++ compilation) through `dlopen` of one library
//! file, named or by full path: several NVRTC versions can be open at once
//! (`libnvrtc.so.12` and `.so.13` have different sonames), and a pip wheel's
//! copy loads from its site-packages path with no loader-path setup. Only
//! `std` and `libc`: `build.rs` compiles the embedded kernel images with the
//! same code.

use std::ffi::{c_char, c_int, c_void, CStr, CString};

type Program = *mut c_void;
type Status = c_int;

type VersionFn = unsafe extern "C" fn(*mut c_int, *mut c_int) -> Status;
type ErrorStringFn = unsafe extern "C" fn(Status) -> *const c_char;
type CreateFn = unsafe extern "C" fn(
    *mut Program,
    *const c_char,
    *const c_char,
    c_int,
    *const *const c_char,
    *const *const c_char,
) -> Status;
type CompileFn = unsafe extern "C" fn(Program, c_int, *const *const c_char) -> Status;
type SizeFn = unsafe extern "C" fn(Program, *mut usize) -> Status;
type GetFn = unsafe extern "C" fn(Program, *mut c_char) -> Status;
type DestroyFn = unsafe extern "C" fn(*mut Program) -> Status;

/// The NVRTC entry points used here (signatures of `nvrtc.h`).
struct Fns {
    version: VersionFn,
    error_string: ErrorStringFn,
    create: CreateFn,
    compile: CompileFn,
    log_size: SizeFn,
    log: GetFn,
    ptx_size: SizeFn,
    ptx: GetFn,
    cubin_size: Option<SizeFn>,
    cubin: Option<GetFn>,
    destroy: DestroyFn,
}

/// One loaded NVRTC library.
pub struct Nvrtc {
    handle: *mut c_void,
    fns: Fns,
    /// What was passed to `dlopen` (a soname or a full path).
    pub path: String,
    /// `nvrtcVersion()`: (major, minor), e.g. (12, 4).
    pub version: (i32, i32),
}

// SAFETY: the handle is only used to resolve symbols at open and to close it
// in Drop; NVRTC's API is thread-safe for distinct programs, and every
// compile creates and destroys its own program.
unsafe impl Send for Nvrtc {}
// SAFETY: as above; no method mutates shared state of this value.
unsafe impl Sync for Nvrtc {}

/// What one compilation produced.
pub struct Compiled {
    /// The PTX text (its `.version` is this NVRTC's PTX ISA).
    pub ptx: String,
    /// The cubin, when the architecture was a real one (`sm_XY`).
    pub cubin: Option<Vec<u8>>,
}

fn dl_error() -> String {
    // SAFETY: dlerror returns a thread-local message or null.
    let e = unsafe { libc::dlerror() };
    if e.is_null() {
        "unknown dlopen error".into()
    } else {
        // SAFETY: non-null dlerror results are NUL-terminated strings.
        unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
    }
}

impl Nvrtc {
    /// Opens `name` (a soname searched on the loader path, or a full path)
    /// and checks it is an NVRTC; the error says why not.
    pub fn open(name: &str) -> Result<Nvrtc, String> {
        let c = CString::new(name).map_err(|_| format!("{name}: NUL in the name"))?;
        // SAFETY: dlopen of a shared library; its constructors are NVRTC's own.
        let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if handle.is_null() {
            return Err(format!("{name}: {}", dl_error()));
        }
        let sym = |s: &CStr| -> *mut c_void {
            // SAFETY: handle is a live dlopen handle; s is NUL-terminated.
            unsafe { libc::dlsym(handle, s.as_ptr()) }
        };
        macro_rules! need {
            ($s:literal, $t:ty) => {{
                let p = sym($s);
                if p.is_null() {
                    // SAFETY: handle came from dlopen above and is closed once.
                    unsafe { libc::dlclose(handle) };
                    return Err(format!("{name}: no symbol {:?} (not an NVRTC)", $s));
                }
                // SAFETY: the symbol is the NVRTC function of this signature (nvrtc.h).
                unsafe { std::mem::transmute::<*mut c_void, $t>(p) }
            }};
        }
        macro_rules! maybe {
            ($s:literal, $t:ty) => {{
                let p = sym($s);
                // SAFETY: as above; null stays None.
                (!p.is_null()).then(|| unsafe { std::mem::transmute::<*mut c_void, $t>(p) })
            }};
        }
        let fns = Fns {
            version: need!(c"nvrtcVersion", VersionFn),
            error_string: need!(c"nvrtcGetErrorString", ErrorStringFn),
            create: need!(c"nvrtcCreateProgram", CreateFn),
            compile: need!(c"nvrtcCompileProgram", CompileFn),
            log_size: need!(c"nvrtcGetProgramLogSize", SizeFn),
            log: need!(c"nvrtcGetProgramLog", GetFn),
            ptx_size: need!(c"nvrtcGetPTXSize", SizeFn),
            ptx: need!(c"nvrtcGetPTX", GetFn),
            cubin_size: maybe!(c"nvrtcGetCUBINSize", SizeFn),
            cubin: maybe!(c"nvrtcGetCUBIN", GetFn),
            destroy: need!(c"nvrtcDestroyProgram", DestroyFn),
        };
        let (mut major, mut minor) = (0, 0);
        // SAFETY: two out-pointers to locals.
        let rc = unsafe { (fns.version)(&mut major, &mut minor) };
        let me = Nvrtc {
            handle,
            fns,
            path: name.to_string(),
            version: (major, minor),
        };
        if rc != 0 {
            return Err(format!("{name}: nvrtcVersion failed: {}", me.error(rc)));
        }
        Ok(me)
    }

    fn error(&self, rc: Status) -> String {
        // SAFETY: nvrtcGetErrorString returns a static string for any code.
        let p = unsafe { (self.fns.error_string)(rc) };
        if p.is_null() {
            format!("NVRTC error {rc}")
        } else {
            // SAFETY: non-null, NUL-terminated static string.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        }
    }

    /// Compiles `src` (named `name` in messages) with `options` (e.g.
    /// `--gpu-architecture=sm_90`); the error carries NVRTC's log.
    pub fn compile(&self, src: &str, name: &str, options: &[&str]) -> Result<Compiled, String> {
        let csrc = CString::new(src).map_err(|_| "NUL in the kernel source".to_string())?;
        let cname = CString::new(name).map_err(|_| "NUL in the program name".to_string())?;
        let opts: Vec<CString> = options
            .iter()
            .map(|o| CString::new(*o).map_err(|_| format!("NUL in option {o:?}")))
            .collect::<Result<_, _>>()?;
        let optp: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();
        let mut prog: Program = std::ptr::null_mut();
        // SAFETY: valid NUL-terminated strings that outlive the call; no headers.
        let rc = unsafe {
            (self.fns.create)(
                &mut prog,
                csrc.as_ptr(),
                cname.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            )
        };
        if rc != 0 {
            return Err(format!("nvrtcCreateProgram: {}", self.error(rc)));
        }
        let out = self.compile_program(prog, &optp);
        // SAFETY: prog was created above and is destroyed once.
        unsafe { (self.fns.destroy)(&mut prog) };
        out
    }

    fn compile_program(&self, prog: Program, opts: &[*const c_char]) -> Result<Compiled, String> {
        let n = c_int::try_from(opts.len()).map_err(|_| "too many NVRTC options".to_string())?;
        // SAFETY: prog is live; opts holds `n` NUL-terminated strings.
        let rc = unsafe { (self.fns.compile)(prog, n, opts.as_ptr()) };
        if rc != 0 {
            let log = self
                .bytes(prog, self.fns.log_size, self.fns.log)
                .map(|b| {
                    String::from_utf8_lossy(&b)
                        .trim_end_matches('\0')
                        .to_string()
                })
                .unwrap_or_default();
            return Err(format!(
                "nvrtcCompileProgram: {}: {}",
                self.error(rc),
                log.trim()
            ));
        }
        let ptx = self.bytes(prog, self.fns.ptx_size, self.fns.ptx)?;
        let ptx = String::from_utf8_lossy(&ptx)
            .trim_end_matches('\0')
            .to_string();
        let cubin = match (self.fns.cubin_size, self.fns.cubin) {
            (Some(size), Some(get)) => self.bytes(prog, size, get).ok().filter(|b| !b.is_empty()),
            _ => None,
        };
        Ok(Compiled { ptx, cubin })
    }

    /// One of the program's outputs through its size and get functions.
    fn bytes(&self, prog: Program, size: SizeFn, get: GetFn) -> Result<Vec<u8>, String> {
        let mut n = 0usize;
        // SAFETY: prog is live; n is a local out-pointer.
        let rc = unsafe { size(prog, &mut n) };
        if rc != 0 {
            return Err(self.error(rc));
        }
        let mut buf = vec![0u8; n];
        // SAFETY: buf holds the `n` bytes NVRTC said it writes.
        let rc = unsafe { get(prog, buf.as_mut_ptr() as *mut c_char) };
        if rc != 0 {
            return Err(self.error(rc));
        }
        Ok(buf)
    }
}

impl std::fmt::Debug for Nvrtc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "NVRTC {}.{} ({})",
            self.version.0, self.version.1, self.path
        )
    }
}

impl Drop for Nvrtc {
    fn drop(&mut self) {
        // SAFETY: the handle came from dlopen in `open` and is closed once.
        unsafe { libc::dlclose(self.handle) };
    }
}
