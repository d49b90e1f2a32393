//! Exporting our GPU memory to same-host peers: the legacy IPC handle of its allocation, or
//! for VMM memory (no legacy handle) its physical chunks, handed out as POSIX fds by our fd
//! socket (fd_share.rs).
use super::core::Core;
use super::gpu::DeviceMem;
use super::wire;
use crate::cuda;

/// How same-host peers open this device memory, where the route is on: the legacy IPC
/// handle of its allocation, or for VMM memory (no legacy handle) its physical chunks
/// handed out as POSIX fds by our fd socket (then also the id the socket knows the
/// registration by). None, with one INFO line saying why, where neither works.
pub fn export(core: &Core, info: &cuda::PointerInfo, dev: &DeviceMem, addr: u64, len: u64) -> Option<(wire::IpcDesc, Option<u64>)> {
    if !core.ipc_enabled() {
        return None;
    }
    let d = cuda::Driver::get().ok()?;
    let uuid = match d.device_uuid(dev.ordinal) {
        Ok(u) => u,
        Err(e) => {
            log::info!("{}: GPU memory at {addr:#x} is not shared with same-host peers ({e}); they stage it through host memory", core.name);
            return None;
        }
    };
    // Legacy first, unless the driver says the memory cannot have such a handle.
    let vmm_memory = info.context.is_none() || d.legacy_ipc_capable(info.range_start) == Some(false);
    let legacy = if vmm_memory {
        Err("VMM memory has no legacy IPC handle".to_string())
    } else if !d.has_ipc() {
        Err("the driver lacks the IPC entry points".to_string())
    } else {
        d.ipc_export(&dev.ctx, info.range_start).map_err(|e| e.to_string())
    };
    let legacy_err = match legacy {
        Ok(h) => {
            return Some((wire::IpcDesc { kind: wire::IPC_KIND_LEGACY, device_uuid: uuid, alloc_base: info.range_start,
                alloc_len: info.range_size, handle: h.0, vmm: None }, None));
        }
        Err(e) => e,
    };
    match export_vmm(core, d, dev, uuid, addr, len) {
        Ok((ipc, reg)) => {
            log::debug!("{}: GPU memory [{addr:#x}, +{len}) shared as {} VMM chunk(s) by fd socket", core.name,
                ipc.vmm.as_ref().map_or(0, |v| v.chunks.len()));
            Some((ipc, Some(reg)))
        }
        Err(e) => {
            let why = if vmm_memory { e } else { format!("{legacy_err}; as VMM memory: {e}") };
            log::info!("{}: GPU memory at {addr:#x} cannot be shared with same-host peers ({why}); they stage it through host memory", core.name);
            None
        }
    }
}

/// The VMM route: the chunks under the registration (each exportable as a POSIX fd),
/// registered with our fd socket under a fresh id.
fn export_vmm(core: &Core, d: &cuda::Driver, dev: &DeviceMem, uuid: [u8; 16], addr: u64, len: u64)
    -> std::result::Result<(wire::IpcDesc, u64), String> {
    if !d.has_vmm_export() {
        return Err("the driver lacks the VMM export entry points".into());
    }
    let chunks = d.vmm_chunks(&dev.ctx, addr, len, wire::VMM_MAX_CHUNKS).map_err(|e| e.to_string())?;
    let (Some(first), Some(last)) = (chunks.first(), chunks.last()) else { return Err("no chunk under the range".into()) };
    let base = first.base;
    let descs: Vec<wire::VmmChunkDesc> = chunks.iter()
        .map(|c| wire::VmmChunkDesc { offset: c.base - base, len: c.len, granularity: c.granularity })
        .collect();
    if descs.iter().any(|c| !c.granularity.is_power_of_two() || c.offset % c.granularity != 0 || c.len % c.granularity != 0) {
        return Err("a chunk is not aligned to its granularity".into());
    }
    let socket = core.fds.name(&core.name).map_err(|e| e.to_string())?;
    let reg_id = super::ids::random_u64();
    core.fds.add(reg_id, dev.ctx, chunks.iter().map(|c| (c.base, c.len)).collect());
    let ipc = wire::IpcDesc {
        kind: wire::IPC_KIND_VMM_FD,
        device_uuid: uuid,
        alloc_base: base,
        alloc_len: last.base + last.len - base,
        handle: [0; wire::IPC_HANDLE_LEN],
        vmm: Some(wire::VmmDesc { reg_id, socket, chunks: descs }),
    };
    Ok((ipc, reg_id))
}
