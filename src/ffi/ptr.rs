//! Every raw-pointer conversion of the C ABI lives here: NULL, alignment and
//! length checks, versioned struct reads and size-limited struct writes.

use crate::error::{Error, Result, Status};
use std::mem::{align_of, size_of};

/// A `#[repr(C)]` struct whose first field is `struct_size: u64` and whose
/// all-zero bit pattern is a valid value (integers and raw pointers only).
///
/// # Safety
/// Implementors must be `#[repr(C)]`, start with a `u64` size field, and be
/// valid when zero-filled.
pub unsafe trait Versioned: Copy {
    /// Size of the oldest accepted version of the struct.
    const MIN_SIZE: usize;
    /// Name used in error messages.
    const NAME: &'static str;
}

/// Checks a caller's versioned struct pointer and returns its `struct_size`.
fn versioned_size<T: Versioned>(p: *const T, role: &str) -> Result<usize> {
    if p.is_null() {
        return Err(Error::new(
            Status::NullArgument,
            format!("{role}{} pointer is NULL", T::NAME),
        ));
    }
    if !(p as usize).is_multiple_of(align_of::<u64>()) {
        return Err(Error::invalid(format!(
            "{role}{} pointer is not 8-byte aligned",
            T::NAME
        )));
    }
    // SAFETY: p is non-NULL and aligned; every Versioned struct starts with its u64 size, set by the caller.
    let size = unsafe { (p as *const u64).read() } as usize;
    if size < T::MIN_SIZE {
        return Err(Error::new(
            Status::AbiMismatch,
            format!(
                "{role}{}.struct_size={size} is smaller than the oldest supported size {}; set struct_size = sizeof({}) before the call",
                T::NAME,
                T::MIN_SIZE,
                T::NAME
            ),
        ));
    }
    Ok(size)
}

/// Reads a versioned struct from the caller: sizes between `MIN_SIZE` and ours
/// are accepted (missing fields read as zero); larger ones too (the extra
/// fields, from a newer header, are ignored).
pub fn read_versioned<T: Versioned>(p: *const T) -> Result<T> {
    let size = versioned_size(p, "")?;
    // SAFETY: Versioned guarantees the all-zero pattern is a valid T.
    let mut out: T = unsafe { std::mem::zeroed() };
    let n = size.min(size_of::<T>());
    // SAFETY: the caller's struct has at least `size >= n` bytes; out has size_of::<T>() >= n; they do not overlap.
    unsafe { std::ptr::copy_nonoverlapping(p as *const u8, &mut out as *mut T as *mut u8, n) };
    Ok(out)
}

/// Writes `value` into the caller's struct, at most its `struct_size` bytes
/// (which the caller set before the call), keeping that size field.
pub fn write_versioned<T: Versioned>(p: *mut T, value: &T) -> Result<()> {
    let size = versioned_size(p, "output ")?;
    let n = size.min(size_of::<T>());
    // SAFETY: skip the 8-byte size field; the caller's struct holds `size >= n` bytes; no overlap with `value`.
    unsafe {
        std::ptr::copy_nonoverlapping(
            (value as *const T as *const u8).add(8),
            (p as *mut u8).add(8),
            n - 8,
        )
    };
    Ok(())
}

/// Reads a caller array of `len` versioned structs, each `struct_size` bytes
/// apart: the first element's `struct_size` is the array's stride (the
/// caller's `sizeof`), and every element must state the same. NULL is
/// accepted only with length 0.
pub fn read_versioned_array<T: Versioned>(p: *const T, len: usize, what: &str) -> Result<Vec<T>> {
    if len == 0 {
        return Ok(Vec::new());
    }
    if p.is_null() {
        return Err(Error::new(
            Status::NullArgument,
            format!("{what} is NULL but its length is {len}"),
        ));
    }
    let stride = versioned_size(p, "")?;
    if !stride.is_multiple_of(align_of::<u64>()) {
        return Err(Error::new(
            Status::AbiMismatch,
            format!("{what}[0].struct_size={stride} is not a multiple of 8"),
        ));
    }
    check_array(p as usize, len, stride, align_of::<u64>(), what)?;
    let mut out = Vec::with_capacity(len);
    for i in 0..len {
        // SAFETY: inside the caller's array of `len` elements `stride` bytes apart (its contract, size checked above).
        let e = unsafe { (p as *const u8).add(i * stride) } as *const T;
        let size = versioned_size(e, "")?;
        if size != stride {
            return Err(Error::new(
                Status::AbiMismatch,
                format!("{what}[{i}].struct_size={size} differs from {what}[0].struct_size={stride}: every element is sizeof({})", T::NAME),
            ));
        }
        out.push(read_versioned(e)?);
    }
    Ok(out)
}

/// A caller array as a slice; NULL is accepted only with length 0.
pub fn slice<'a, T>(p: *const T, len: usize, what: &str) -> Result<&'a [T]> {
    if len == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(Error::new(
            Status::NullArgument,
            format!("{what} is NULL but its length is {len}"),
        ));
    }
    check_array(p as usize, len, size_of::<T>(), align_of::<T>(), what)?;
    // SAFETY: non-NULL, aligned, length fits isize; the caller promises len readable elements for the call's duration.
    Ok(unsafe { std::slice::from_raw_parts(p, len) })
}

/// A caller output array as a mutable slice; NULL is accepted only with length 0.
pub fn slice_mut<'a, T>(p: *mut T, len: usize, what: &str) -> Result<&'a mut [T]> {
    if len == 0 {
        return Ok(&mut []);
    }
    if p.is_null() {
        return Err(Error::new(
            Status::NullArgument,
            format!("{what} is NULL but its capacity is {len}"),
        ));
    }
    check_array(p as usize, len, size_of::<T>(), align_of::<T>(), what)?;
    // SAFETY: non-NULL, aligned, length fits isize; the caller promises len writable elements not aliased during the call.
    Ok(unsafe { std::slice::from_raw_parts_mut(p, len) })
}

fn check_array(addr: usize, len: usize, size: usize, align: usize, what: &str) -> Result<()> {
    if !addr.is_multiple_of(align) {
        return Err(Error::invalid(format!(
            "{what} is not {align}-byte aligned"
        )));
    }
    match len.checked_mul(size) {
        Some(b) if b <= isize::MAX as usize => Ok(()),
        _ => Err(Error::invalid(format!("{what} length {len} is too large"))),
    }
}

/// Checks, before a call does anything, that [`write_versioned`] will accept
/// `p` (non-NULL, aligned, `struct_size` large enough): a call refused for
/// its output struct must not have registered, consumed or sent anything.
pub fn check_versioned_out<T: Versioned>(p: *mut T) -> Result<()> {
    versioned_size(p, "output ").map(|_| ())
}

/// Checks, before a call does anything, that [`write_out`] and
/// [`new_handle`] will accept `p` (non-NULL and aligned).
pub fn check_out<T>(p: *mut T, what: &str) -> Result<()> {
    if p.is_null() {
        return Err(Error::new(Status::NullArgument, format!("{what} is NULL")));
    }
    if !(p as usize).is_multiple_of(align_of::<T>()) {
        return Err(Error::invalid(format!("{what} is not aligned")));
    }
    Ok(())
}

/// Writes `v` through an out-pointer that must not be NULL.
pub fn write_out<T>(p: *mut T, v: T, what: &str) -> Result<()> {
    if p.is_null() {
        return Err(Error::new(Status::NullArgument, format!("{what} is NULL")));
    }
    if !(p as usize).is_multiple_of(align_of::<T>()) {
        return Err(Error::invalid(format!("{what} is not aligned")));
    }
    // SAFETY: non-NULL and aligned; the caller provides a writable T.
    unsafe { p.write(v) };
    Ok(())
}

/// Copies `items` into the caller's array of `capacity`, writing the needed
/// length to `out_len`. A NULL array with capacity 0 is a size query.
pub fn fill<T: Copy>(
    items: &[T],
    dst: *mut T,
    capacity: usize,
    out_len: *mut usize,
    what: &str,
) -> Result<Status> {
    write_out(out_len, items.len(), "out_len")?;
    if dst.is_null() && capacity == 0 {
        return Ok(Status::Ok);
    }
    if capacity < items.len() {
        return Err(Error::new(
            Status::BufferTooSmall,
            format!(
                "{what} holds {capacity} items but {} are needed (written to out_len)",
                items.len()
            ),
        ));
    }
    let out = slice_mut(dst, items.len(), what)?;
    out.copy_from_slice(items);
    Ok(Status::Ok)
}

/// Destroys a handle created by [`new_handle`]; NULL is a no-op.
pub fn drop_handle<T>(p: *mut T) {
    drop(take_handle(p));
}

/// A NUL-terminated UTF-8 string argument.
pub fn c_str<'a>(p: *const std::ffi::c_char, what: &str) -> Result<&'a str> {
    if p.is_null() {
        return Err(Error::new(Status::NullArgument, format!("{what} is NULL")));
    }
    // SAFETY: non-NULL; the caller promises a NUL-terminated string valid for the call.
    unsafe { std::ffi::CStr::from_ptr(p) }
        .to_str()
        .map_err(|_| Error::new(Status::InvalidUtf8, format!("{what} is not valid UTF-8")))
}

/// Copies `s` plus a NUL into `buf` of `cap` bytes; the needed size (with
/// the NUL) goes to `out_len`. A NULL buffer with capacity 0 is a size query.
pub fn write_c_str(
    s: &str,
    buf: *mut std::ffi::c_char,
    cap: usize,
    out_len: *mut usize,
) -> Result<Status> {
    fill_str(s, buf, cap, out_len, "string buffer")
}

/// A caller's raw memory range as an address for registration (no access made here).
pub fn raw_range(p: *mut std::ffi::c_void, len: usize, what: &str) -> Result<*mut u8> {
    if p.is_null() {
        return Err(Error::new(Status::NullArgument, format!("{what} is NULL")));
    }
    if len == 0 || (p as usize).checked_add(len).is_none() {
        return Err(Error::invalid(format!(
            "{what} length {len} is 0 or wraps the address space"
        )));
    }
    Ok(p as *mut u8)
}

/// Like [`c_str`], but NULL means "not given".
pub fn opt_c_str<'a>(p: *const std::ffi::c_char, what: &str) -> Result<Option<&'a str>> {
    if p.is_null() {
        Ok(None)
    } else {
        c_str(p, what).map(Some)
    }
}

/// Copies `s` and a terminating NUL into the caller's buffer of `capacity`
/// bytes, writing the needed size (NUL included) to `out_len`. A NULL buffer
/// with capacity 0 is a size query.
pub fn fill_str(
    s: &str,
    dst: *mut std::ffi::c_char,
    capacity: usize,
    out_len: *mut usize,
    what: &str,
) -> Result<Status> {
    let mut bytes: Vec<std::ffi::c_char> = s.bytes().map(|b| b as std::ffi::c_char).collect();
    bytes.push(0);
    fill(&bytes, dst, capacity, out_len, what)
}

/// Moves `v` to the heap and writes the new handle to `out` (which must not be NULL).
pub fn new_handle<T>(v: T, out: *mut *mut T, what: &str) -> Result<()> {
    if out.is_null() {
        return Err(Error::new(
            Status::NullArgument,
            format!("{what} output pointer is NULL"),
        ));
    }
    write_out(out, Box::into_raw(Box::new(v)), what)
}

/// Borrows a handle created by [`new_handle`]; NULL is an error naming `what`.
pub fn handle<'a, T>(p: *const T, what: &str) -> Result<&'a T> {
    if p.is_null() {
        return Err(Error::new(
            Status::NullArgument,
            format!("{what} handle is NULL"),
        ));
    }
    if !(p as usize).is_multiple_of(align_of::<T>()) {
        return Err(Error::invalid(format!(
            "{what} handle is not aligned (not a pdxfer handle?)"
        )));
    }
    // SAFETY: non-NULL and aligned; the caller passes a live handle from new_handle, not yet destroyed.
    Ok(unsafe { &*p })
}

/// Takes back ownership of a handle for destruction; NULL gives `None`.
pub fn take_handle<T>(p: *mut T) -> Option<Box<T>> {
    if p.is_null() {
        None
    } else {
        // SAFETY: the caller passes a handle from new_handle exactly once (destroy contract).
        Some(unsafe { Box::from_raw(p) })
    }
}
