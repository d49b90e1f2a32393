//! One kernel launch for many device-to-device copies: KV blocks are thousands of small
//! ranges, and the copy engines pay a few microseconds per range whether they come one
//! call at a time or in one cuMemcpyBatchAsync (measured on the H200: ~4-5 us per block,
//! so 4096 x 4 KiB moved at ~1 GB/s). A kernel whose CTAs each copy a slice of one range
//! moves them all at memory speed.
//!
//! The kernel is PTX text kept here (no CUDA compiler at build time, rule 9), JIT-compiled
//! by the driver into each context that uses it. The ranges travel in the kernel's
//! parameter block, which the driver copies at launch: nothing to allocate, and nothing
//! that must outlive the launch. Two forms: a 32 KiB parameter block (PTX ISA 8.1, CUDA
//! 12.1+ drivers, 1364 ranges per launch) and, where the driver refuses that, the classic
//! 4 KiB block (181 ranges per launch).
use super::context::{Context, Pushed};
use super::driver::Driver;
use super::error::Result;
use super::stream::Stream;
use super::sys::*;
use std::ffi::c_void;

/// Bytes of one range in the parameter block: dst, src, len (u64 each).
const ENTRY_BYTES: usize = 24;
/// The parameter block's header: u32 range count, u32 log2 of the bytes one CTA copies.
const HEADER_BYTES: usize = 8;
/// log2 of the slice of a range that one CTA copies (64 KiB).
const SLICE_SHIFT: u32 = 16;
const THREADS: u32 = 256;
const NAME: &[u8] = b"nf_gather\0";

/// The two forms: PTX ISA version and parameter block size (the largest each ISA allows,
/// rounded down to whole ranges).
const FORMS: [(&str, usize); 2] = [
    ("8.1", HEADER_BYTES + 1364 * ENTRY_BYTES),
    ("7.0", HEADER_BYTES + 181 * ENTRY_BYTES),
];

/// CTA (x = slice, y = range) copies slice x of range y: 16-byte vectors (four per thread
/// per step) where both ends are 16-byte aligned, bytes otherwise; slices past a range's
/// end exit at once, so ranges of mixed lengths share one launch.
const PTX: &str = r#".version @VERSION@
.target sm_70
.address_size 64

.visible .entry nf_gather(
    .param .align 8 .b8 nf_p[@BYTES@]
)
{
    .reg .pred %p<8>;
    .reg .b32 %r<32>;
    .reg .b64 %rd<40>;

    mov.u32 %r1, %ctaid.y;
    ld.param.u32 %r2, [nf_p];
    setp.ge.u32 %p1, %r1, %r2;
    @%p1 bra DONE;
    ld.param.u32 %r3, [nf_p+4];
    mov.u64 %rd1, nf_p;
    mul.wide.u32 %rd2, %r1, 24;
    add.u64 %rd3, %rd1, %rd2;
    ld.param.u64 %rd4, [%rd3+8];
    ld.param.u64 %rd5, [%rd3+16];
    ld.param.u64 %rd6, [%rd3+24];
    mov.u32 %r4, %ctaid.x;
    cvt.u64.u32 %rd7, %r4;
    shl.b64 %rd8, %rd7, %r3;
    setp.ge.u64 %p2, %rd8, %rd6;
    @%p2 bra DONE;
    mov.u64 %rd9, 1;
    shl.b64 %rd10, %rd9, %r3;
    add.u64 %rd11, %rd8, %rd10;
    min.u64 %rd12, %rd11, %rd6;
    mov.u32 %r5, %tid.x;
    mov.u32 %r6, %ntid.x;
    cvt.u64.u32 %rd13, %r5;
    cvt.u64.u32 %rd14, %r6;
    or.b64 %rd15, %rd4, %rd5;
    and.b64 %rd16, %rd15, 15;
    setp.ne.u64 %p3, %rd16, 0;
    @%p3 bra BYTES;
    sub.u64 %rd17, %rd12, %rd8;
    and.b64 %rd18, %rd17, -16;
    add.u64 %rd19, %rd8, %rd18;
    shl.b64 %rd20, %rd13, 4;
    add.u64 %rd21, %rd8, %rd20;
    shl.b64 %rd22, %rd14, 4;
    mul.lo.u64 %rd25, %rd22, 3;
    shl.b64 %rd30, %rd22, 2;
VLOOP4:
    add.u64 %rd26, %rd21, %rd25;
    setp.ge.u64 %p6, %rd26, %rd19;
    @%p6 bra VLOOP;
    add.u64 %rd23, %rd5, %rd21;
    add.u64 %rd27, %rd23, %rd22;
    add.u64 %rd28, %rd27, %rd22;
    add.u64 %rd29, %rd28, %rd22;
    ld.global.v4.u32 {%r8, %r9, %r10, %r11}, [%rd23];
    ld.global.v4.u32 {%r12, %r13, %r14, %r15}, [%rd27];
    ld.global.v4.u32 {%r16, %r17, %r18, %r19}, [%rd28];
    ld.global.v4.u32 {%r20, %r21, %r22, %r23}, [%rd29];
    add.u64 %rd24, %rd4, %rd21;
    add.u64 %rd31, %rd24, %rd22;
    add.u64 %rd32, %rd31, %rd22;
    add.u64 %rd33, %rd32, %rd22;
    st.global.v4.u32 [%rd24], {%r8, %r9, %r10, %r11};
    st.global.v4.u32 [%rd31], {%r12, %r13, %r14, %r15};
    st.global.v4.u32 [%rd32], {%r16, %r17, %r18, %r19};
    st.global.v4.u32 [%rd33], {%r20, %r21, %r22, %r23};
    add.u64 %rd21, %rd21, %rd30;
    bra VLOOP4;
VLOOP:
    setp.ge.u64 %p4, %rd21, %rd19;
    @%p4 bra VTAIL;
    add.u64 %rd23, %rd5, %rd21;
    add.u64 %rd24, %rd4, %rd21;
    ld.global.v4.u32 {%r8, %r9, %r10, %r11}, [%rd23];
    st.global.v4.u32 [%rd24], {%r8, %r9, %r10, %r11};
    add.u64 %rd21, %rd21, %rd22;
    bra VLOOP;
VTAIL:
    mov.u64 %rd8, %rd19;
BYTES:
    add.u64 %rd21, %rd8, %rd13;
BLOOP:
    setp.ge.u64 %p5, %rd21, %rd12;
    @%p5 bra DONE;
    add.u64 %rd23, %rd5, %rd21;
    add.u64 %rd24, %rd4, %rd21;
    ld.global.u8 %r8, [%rd23];
    st.global.u8 [%rd24], %r8;
    add.u64 %rd21, %rd21, %rd14;
    bra BLOOP;
DONE:
    ret;
}
"#;

/// The PTX of one form, NUL-terminated as cuModuleLoadData wants it.
fn ptx(version: &str, bytes: usize) -> String {
    let mut s = PTX.replace("@VERSION@", version).replace("@BYTES@", &bytes.to_string());
    s.push('\0');
    s
}

/// The gather-copy kernel loaded into one context; unloaded on drop.
pub struct CopyKernel {
    module: CUmodule,
    func: CUfunction,
    ctx: Context,
    param_bytes: usize,
}

// SAFETY: module and function are opaque driver handles, usable from any thread with the
// context current.
unsafe impl Send for CopyKernel {}
// SAFETY: as above; the methods only pass the handles to the driver.
unsafe impl Sync for CopyKernel {}

impl CopyKernel {
    /// Loads the kernel into `ctx` (pushed for the call): the large-parameter form, else
    /// the classic one. Errors where the driver has no module API or JIT refuses both.
    pub fn load(ctx: &Context) -> Result<CopyKernel> {
        let d = Driver::get()?;
        let load = d.opt(d.f.module_load_data, "cuModuleLoadData")?;
        let get = d.opt(d.f.module_get_function, "cuModuleGetFunction")?;
        d.opt(d.f.launch_kernel, "cuLaunchKernel")?;
        let _g = Pushed::new(d, *ctx)?;
        let mut last = None;
        for (version, bytes) in FORMS {
            let text = ptx(version, bytes);
            let mut module: CUmodule = std::ptr::null_mut();
            // SAFETY: text is NUL-terminated PTX that lives for the call; module is a
            // valid out-pointer; a context is current (pushed).
            if let Err(e) = d.check("cuModuleLoadData", unsafe { load(&mut module, text.as_ptr() as *const c_void) }) {
                log::debug!("copy kernel (PTX {version}, {bytes}-byte parameters) not loaded: {e}");
                last = Some(e);
                continue;
            }
            let mut func: CUfunction = std::ptr::null_mut();
            // SAFETY: module was just loaded; NAME is NUL-terminated; func is an out-pointer.
            let r = unsafe { get(&mut func, module, NAME.as_ptr() as *const _) };
            let k = CopyKernel { module, func, ctx: *ctx, param_bytes: bytes };
            match d.check("cuModuleGetFunction", r) {
                Ok(()) => return Ok(k),
                Err(e) => last = Some(e), // k unloads the module
            }
        }
        Err(last.unwrap_or(d.err("cuModuleLoadData", CUDA_ERROR_NOT_SUPPORTED)))
    }

    /// Ranges one launch carries.
    pub fn ranges_per_launch(&self) -> usize {
        (self.param_bytes - HEADER_BYTES) / ENTRY_BYTES
    }

    /// Queues `copies` (dst, src, len; device-addressable on both ends, in this kernel's
    /// context, which must be current) on `stream`, in launches of at most
    /// [`ranges_per_launch`](Self::ranges_per_launch). Returns the number of launches.
    ///
    /// # Safety
    /// Every range must stay valid, and the destinations untouched by anyone else, until
    /// the launches complete (an event recorded after them reports ready).
    pub unsafe fn launch(&self, stream: &Stream, copies: &[(u64, u64, usize)]) -> Result<usize> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.launch_sliced(stream, copies, SLICE_SHIFT) }
    }

    /// [`launch`](Self::launch) with one CTA per `1 << slice_shift` bytes of a range (12..=20).
    ///
    /// # Safety
    /// As for [`launch`](Self::launch).
    pub unsafe fn launch_sliced(&self, stream: &Stream, copies: &[(u64, u64, usize)], slice_shift: u32) -> Result<usize> {
        let d = Driver::get()?;
        let slice_shift = slice_shift.clamp(12, 20);
        let launch = d.opt(d.f.launch_kernel, "cuLaunchKernel")?;
        let mut block = vec![0u64; self.param_bytes / 8];
        let mut launches = 0;
        for group in copies.chunks(self.ranges_per_launch()) {
            let longest = group.iter().map(|c| c.2).max().unwrap_or(0);
            if longest == 0 {
                continue;
            }
            block[0] = group.len() as u64 | (u64::from(slice_shift) << 32);
            for (i, &(dst, src, len)) in group.iter().enumerate() {
                block[1 + 3 * i] = dst;
                block[2 + 3 * i] = src;
                block[3 + 3 * i] = len as u64;
            }
            let slices = longest.div_ceil(1 << slice_shift);
            let grid_x = u32::try_from(slices).map_err(|_| d.err("cuLaunchKernel", CUDA_ERROR_INVALID_VALUE))?;
            let mut arg = block.as_mut_ptr() as *mut c_void;
            // SAFETY: one parameter, a block of param_bytes bytes as the kernel declares
            // it, read by the driver during the call; the caller keeps the ranges valid.
            let r = unsafe {
                launch(self.func, grid_x, group.len() as u32, 1, THREADS, 1, 1, 0, stream.raw(), &mut arg, std::ptr::null_mut())
            };
            d.check("cuLaunchKernel", r)?;
            launches += 1;
        }
        Ok(launches)
    }
}

impl Drop for CopyKernel {
    fn drop(&mut self) {
        let Ok(d) = Driver::get() else { return };
        let Some(unload) = d.f.module_unload else { return };
        let g = Pushed::new(d, self.ctx);
        // SAFETY: the module is ours and is not used after this.
        if let Err(e) = d.check("cuModuleUnload", unsafe { unload(self.module) }) {
            log::warn!("{e}");
        }
        drop(g);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forms_fit_their_isa_limits() {
        // PTX before 8.1 allows 4352 parameter bytes, 8.1+ 32764.
        assert!(FORMS[1].1 <= 4352 && FORMS[0].1 <= 32764);
        for (_, b) in FORMS {
            assert_eq!((b - HEADER_BYTES) % ENTRY_BYTES, 0);
            assert_eq!(b % 8, 0);
        }
        let p = ptx("7.0", FORMS[1].1);
        assert!(p.contains(".version 7.0") && p.contains("nf_p[4352]") && p.ends_with('\0'));
    }
}
