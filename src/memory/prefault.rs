//! Faulting a range of this process's memory in without touching its bytes,
//! so the first transfer into it takes no page faults, and asking for huge
//! pages on it first, so copies through it take fewer TLB misses.

/// Populates the page tables of `[addr, addr + len)` writable now
/// (`MADV_POPULATE_WRITE`, Linux 5.14+), as a write to every page would, but
/// without changing a byte. The range is widened to whole pages (the pages
/// holding its first and last byte are mapped, since the range is).
/// Returns `Err` with the OS error where the kernel refuses (older kernels:
/// `EINVAL`; memory that cannot be written, e.g. a read-only mapping: `EFAULT`;
/// a hole: `ENOMEM`); nothing else happens then.
///
/// # Safety
/// `[addr, addr + len)` is mapped memory of this process.
pub unsafe fn populate_write(addr: *mut u8, len: usize) -> std::io::Result<()> {
    if len == 0 {
        return Ok(());
    }
    let page = page_size();
    let start = (addr as usize) & !(page - 1);
    let end = (addr as usize)
        .checked_add(len)
        .and_then(|e| e.checked_next_multiple_of(page))
        .ok_or_else(|| std::io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: [start, end) covers only pages of the caller's mapped range; the
    // advice faults them in writable and changes no byte.
    let r = unsafe {
        libc::madvise(
            start as *mut libc::c_void,
            end - start,
            libc::MADV_POPULATE_WRITE,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Asks the kernel to back `[addr, addr + len)` with transparent huge pages
/// where it can (`MADV_HUGEPAGE`): the 2 MiB-aligned parts of the range, on
/// pages faulted in from now on. Where the system's setting does not allow
/// them (`transparent_hugepage/enabled` or, for shared memory,
/// `shmem_enabled` at `never`) the advice changes nothing. Returns `Err`
/// with the OS error where the kernel refuses (no THP support: `EINVAL`);
/// no byte changes either way.
///
/// # Safety
/// `[addr, addr + len)` is mapped memory of this process.
pub unsafe fn advise_huge_pages(addr: *mut u8, len: usize) -> std::io::Result<()> {
    if len == 0 {
        return Ok(());
    }
    let page = page_size();
    let start = (addr as usize) & !(page - 1);
    let end = (addr as usize)
        .checked_add(len)
        .and_then(|e| e.checked_next_multiple_of(page))
        .ok_or_else(|| std::io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: [start, end) covers only pages of the caller's mapped range; the
    // advice changes how later faults are served, never a byte.
    let r = unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Pages of `[addr, addr + len)` resident in memory (`mincore`), or `None`
/// where the kernel refuses.
///
/// # Safety
/// `[addr, addr + len)` is mapped memory of this process.
pub unsafe fn resident_pages(addr: *const u8, len: usize) -> Option<usize> {
    let page = page_size();
    let start = (addr as usize) & !(page - 1);
    let end = (addr as usize)
        .checked_add(len)?
        .checked_next_multiple_of(page)?;
    let mut vec = vec![0u8; (end - start) / page];
    // SAFETY: [start, end) lies in the caller's mapping; `vec` holds one byte per page.
    let r = unsafe {
        libc::mincore(
            start as *mut libc::c_void,
            end - start,
            vec.as_mut_ptr() as *mut libc::c_uchar,
        )
    };
    (r == 0).then(|| vec.iter().filter(|&&b| b & 1 != 0).count())
}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as usize
    } else {
        4096
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh anonymous mapping of `pages` pages (no page touched yet).
    fn fresh(pages: usize) -> (*mut u8, usize) {
        let len = pages * page_size();
        // SAFETY: a new private anonymous mapping; checked for MAP_FAILED.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        (p as *mut u8, len)
    }

    #[test]
    fn huge_page_advice_then_population_keeps_the_bytes() {
        let (p, len) = fresh(1024);
        // SAFETY: p/len is the mapping made above, for every call below.
        unsafe {
            std::ptr::write_bytes(p.add(4096), 0x5a, 100);
            match advise_huge_pages(p, len) {
                Ok(()) => {}
                // a kernel without transparent huge pages refuses the advice
                Err(e) => assert_eq!(e.raw_os_error(), Some(libc::EINVAL), "{e}"),
            }
            populate_write(p, len).expect("MADV_POPULATE_WRITE (Linux 5.14+)");
            assert_eq!(resident_pages(p, len), Some(len / page_size()));
            let s = std::slice::from_raw_parts(p, len);
            assert!(s[4096..4196].iter().all(|&b| b == 0x5a));
            assert!(s[..4096].iter().chain(&s[4196..]).all(|&b| b == 0));
            libc::munmap(p as *mut libc::c_void, len);
        }
    }

    #[test]
    fn populate_write_makes_every_page_resident_and_keeps_the_bytes() {
        let (p, len) = fresh(64);
        // SAFETY: p/len is the mapping made above, for every call below.
        unsafe {
            assert_eq!(
                resident_pages(p, len),
                Some(0),
                "a fresh mapping has no page yet"
            );
            // a byte written before populating must survive it
            *p.add(5 * page_size() + 7) = 0xAB;
            // an unaligned range inside the mapping covers its whole pages
            populate_write(p.add(100), len - 200).expect("MADV_POPULATE_WRITE (Linux 5.14+)");
            assert_eq!(resident_pages(p, len), Some(64));
            assert_eq!(*p.add(5 * page_size() + 7), 0xAB);
            assert_eq!(*p.add(6 * page_size()), 0);
            libc::munmap(p as *mut libc::c_void, len);
        }
    }

    #[test]
    fn populate_write_refuses_a_read_only_mapping_and_changes_nothing() {
        let (p, len) = fresh(4);
        // SAFETY: p/len is the mapping made above.
        unsafe {
            assert_eq!(
                libc::mprotect(p as *mut libc::c_void, len, libc::PROT_READ),
                0
            );
            assert!(populate_write(p, len).is_err());
            assert_eq!(resident_pages(p, len), Some(0));
            libc::munmap(p as *mut libc::c_void, len);
        }
    }
}
