//! What the driver knows about an address: memory type, owning context, device, range.
use super::context::Context;
use super::driver::Driver;
use super::error::Result;
use super::sys::*;
use std::ffi::c_void;

/// Where an address lives, as the driver classifies it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryType {
    /// Not known to CUDA: plain (pageable) host memory, or garbage.
    Unregistered,
    /// Host memory known to CUDA (cuMemHostAlloc, cuMemHostRegister).
    Host,
    /// Device memory (cuMemAlloc, cudaMalloc, pools, VMM mappings).
    Device,
    /// A CUDA array.
    Array,
    /// Unified (CU_MEMORYTYPE_UNIFIED).
    Unified,
    /// A value this build does not know.
    Other(u32),
}

impl MemoryType {
    pub(super) fn from_raw(v: u32) -> MemoryType {
        match v {
            0 => MemoryType::Unregistered,
            CU_MEMORYTYPE_HOST => MemoryType::Host,
            CU_MEMORYTYPE_DEVICE => MemoryType::Device,
            CU_MEMORYTYPE_ARRAY => MemoryType::Array,
            CU_MEMORYTYPE_UNIFIED => MemoryType::Unified,
            x => MemoryType::Other(x),
        }
    }
}

/// The attributes of one address (cuPointerGetAttributes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PointerInfo {
    pub memory_type: MemoryType,
    /// The context the memory was allocated or registered in. None for unregistered
    /// memory, and also for device memory that belongs to no context (stream-ordered pool
    /// allocations, cuMemCreate/cuMemMap mappings): use the primary context of
    /// `device_ordinal` for those.
    pub context: Option<Context>,
    /// The device the memory was allocated or registered against; None when unregistered.
    pub device_ordinal: Option<i32>,
    /// Start and size of the allocation (or reserved address range) holding the address;
    /// 0 when unknown.
    pub range_start: u64,
    pub range_size: u64,
    /// Managed (unified) memory.
    pub is_managed: bool,
}

impl PointerInfo {
    /// Known to CUDA as device memory.
    pub fn is_device(&self) -> bool {
        self.memory_type == MemoryType::Device
    }

    /// Whether [addr, addr + len) lies inside the reported range (false when the range is
    /// unknown).
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        let Some(end) = addr.checked_add(len) else { return false };
        let Some(range_end) = self.range_start.checked_add(self.range_size) else { return false };
        self.range_size > 0 && addr >= self.range_start && end <= range_end
    }

    const UNREGISTERED: PointerInfo = PointerInfo {
        memory_type: MemoryType::Unregistered,
        context: None,
        device_ordinal: None,
        range_start: 0,
        range_size: 0,
        is_managed: false,
    };
}

/// Attributes asked for, in slot order.
const ATTRS: [CUpointer_attribute; 6] = [
    CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
    CU_POINTER_ATTRIBUTE_CONTEXT,
    CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
    CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
    CU_POINTER_ATTRIBUTE_RANGE_SIZE,
    CU_POINTER_ATTRIBUTE_IS_MANAGED,
];

/// Each attribute is written into its own zeroed 8-byte slot, whatever its C width
/// (unsigned int, int, pointer, size_t, bool): the value is read back from the slot's first
/// bytes at its own width, and booleans as "any byte set".
pub(super) fn lo_u32(slot: u64) -> u32 {
    let b = slot.to_ne_bytes();
    u32::from_ne_bytes([b[0], b[1], b[2], b[3]])
}

pub(super) fn info_from_slots(s: &[u64; 6]) -> PointerInfo {
    let memory_type = MemoryType::from_raw(lo_u32(s[0]));
    if memory_type == MemoryType::Unregistered {
        return PointerInfo::UNREGISTERED;
    }
    let ordinal = lo_u32(s[2]) as i32;
    PointerInfo {
        memory_type,
        context: Context::from_driver(s[1] as usize as CUcontext),
        device_ordinal: (ordinal >= 0).then_some(ordinal),
        range_start: s[3],
        range_size: s[4],
        is_managed: s[5] != 0,
    }
}

impl Driver {
    /// Classifies `addr`. Never dereferences it, needs no current context, and works for
    /// any value: plain host memory (e.g. a host pointer passed as VRAM) comes back as
    /// [`MemoryType::Unregistered`], not as an error.
    pub fn pointer_info(&self, addr: u64) -> Result<PointerInfo> {
        if let Some(get_all) = self.f.pointer_get_attributes {
            let mut attrs = ATTRS;
            let mut slots = [0u64; 6];
            let mut ptrs: [*mut c_void; 6] = [std::ptr::null_mut(); 6];
            for (p, s) in ptrs.iter_mut().zip(slots.iter_mut()) {
                *p = s as *mut u64 as *mut c_void;
            }
            // SAFETY: attrs, ptrs and the six 8-byte slots they point to are live for the
            // call; each attribute's value is at most 8 bytes; addr is only looked up.
            let r = unsafe { get_all(ATTRS.len() as u32, attrs.as_mut_ptr(), ptrs.as_mut_ptr(), addr) };
            if r == CUDA_SUCCESS {
                return Ok(info_from_slots(&slots));
            }
            if r != CUDA_ERROR_INVALID_VALUE {
                return Err(self.err("cuPointerGetAttributes", r));
            }
            // INVALID_VALUE: maybe one attribute this driver rejects; ask one at a time.
        }
        self.pointer_info_one_by_one(addr)
    }

    /// The cuPointerGetAttribute path: INVALID_VALUE on the memory type means the driver
    /// does not know the address; other attributes it cannot give stay at their defaults.
    fn pointer_info_one_by_one(&self, addr: u64) -> Result<PointerInfo> {
        let get = self.f.pointer_get_attribute;
        let mut slots = [0u64; 6];
        for (i, (&a, s)) in ATTRS.iter().zip(slots.iter_mut()).enumerate() {
            // SAFETY: s is a live zeroed 8-byte slot; each attribute's value fits in it.
            let r = unsafe { get(s as *mut u64 as *mut c_void, a, addr) };
            match r {
                CUDA_SUCCESS => {}
                CUDA_ERROR_INVALID_VALUE if i == 0 => return Ok(PointerInfo::UNREGISTERED),
                CUDA_ERROR_INVALID_VALUE => *s = if a == CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL { u32::MAX as u64 } else { 0 },
                _ => return Err(self.err("cuPointerGetAttribute", r)),
            }
        }
        Ok(info_from_slots(&slots))
    }
}
