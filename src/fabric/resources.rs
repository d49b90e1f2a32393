//! Owning wrappers of libfabric objects. Each holds its parent alive and closes its fid on
//! drop, so a child can never outlive the object it was opened from.
use super::sys;
use super::fab_err;
use crate::error::Result;
use std::ptr;
use std::sync::Arc;

macro_rules! owned_fid {
    ($name:ident, $raw:ty, $parent:ty) => {
        pub(crate) struct $name {
            pub(super) raw: *mut $raw,
            _parent: $parent,
        }
        // SAFETY: the fid is used by one owner at a time (the engine's driver lock or
        // progress thread), and libfabric objects may move between threads.
        unsafe impl Send for $name {}
        unsafe impl Sync for $name {}
        impl Drop for $name {
            fn drop(&mut self) {
                // SAFETY: raw is a live fid opened by this wrapper; closed exactly once.
                let ret = unsafe { sys::nf_fi_close(&mut (*self.raw).fid) };
                if ret != 0 {
                    log::warn!("fi_close({}) failed: {}", stringify!($name), super::strerror(ret));
                }
            }
        }
    };
}

owned_fid!(Fabric, sys::fid_fabric, ());
owned_fid!(Domain, sys::fid_domain, Arc<Fabric>);
owned_fid!(Cq, sys::fid_cq, Arc<Domain>);
owned_fid!(Av, sys::fid_av, Arc<Domain>);
owned_fid!(Endpoint, sys::fid_ep, (Arc<Cq>, Arc<Av>));

impl Fabric {
    pub(crate) fn open(info: *mut sys::fi_info, rail: usize) -> Result<Arc<Fabric>> {
        let mut raw = ptr::null_mut();
        // SAFETY: info is a valid fi_info; raw receives a new fabric.
        let ret = unsafe { sys::fi_fabric((*info).fabric_attr, &mut raw, ptr::null_mut()) };
        if ret != 0 {
            return Err(fab_err("fi_fabric", Some(rail), ret as i64));
        }
        Ok(Arc::new(Fabric { raw, _parent: () }))
    }
}

impl Domain {
    pub(crate) fn open(fabric: &Arc<Fabric>, info: *mut sys::fi_info, rail: usize) -> Result<Arc<Domain>> {
        let mut raw = ptr::null_mut();
        // SAFETY: fabric is live; info is valid.
        let ret = unsafe { sys::nf_fi_domain(fabric.raw, info, &mut raw, ptr::null_mut()) };
        if ret != 0 {
            return Err(fab_err("fi_domain", Some(rail), ret as i64));
        }
        Ok(Arc::new(Domain { raw, _parent: fabric.clone() }))
    }
}

impl Cq {
    /// Opens a message-format CQ, with a wait fd when `want_fd` and the provider offers one.
    pub(crate) fn open(domain: &Arc<Domain>, size: usize, want_fd: bool, rail: usize) -> Result<Arc<Cq>> {
        let mut attr = sys::fi_cq_attr {
            size,
            format: sys::fi_cq_format_FI_CQ_FORMAT_MSG,
            wait_obj: if want_fd { sys::fi_wait_obj_FI_WAIT_FD } else { sys::fi_wait_obj_FI_WAIT_NONE },
            ..Default::default()
        };
        let mut raw = ptr::null_mut();
        // SAFETY: domain is live; attr is fully initialised.
        let ret = unsafe { sys::nf_fi_cq_open(domain.raw, &mut attr, &mut raw, ptr::null_mut()) };
        if ret != 0 {
            return Err(fab_err("fi_cq_open", Some(rail), ret as i64));
        }
        Ok(Arc::new(Cq { raw, _parent: domain.clone() }))
    }

    pub(crate) fn wait_fd(&self) -> Option<i32> {
        let mut fd: i32 = -1;
        // SAFETY: raw is a live CQ; fd is a valid out pointer.
        let ret = unsafe { sys::nf_fi_cq_wait_fd(self.raw, &mut fd) };
        (ret == 0 && fd >= 0).then_some(fd)
    }
}

impl Av {
    pub(crate) fn open(domain: &Arc<Domain>, rail: usize) -> Result<Arc<Av>> {
        let mut attr = sys::fi_av_attr { type_: sys::fi_av_type_FI_AV_TABLE, count: 64, ..Default::default() };
        let mut raw = ptr::null_mut();
        // SAFETY: domain is live; attr initialised.
        let ret = unsafe { sys::nf_fi_av_open(domain.raw, &mut attr, &mut raw, ptr::null_mut()) };
        if ret != 0 {
            return Err(fab_err("fi_av_open", Some(rail), ret as i64));
        }
        Ok(Arc::new(Av { raw, _parent: domain.clone() }))
    }
}

impl Endpoint {
    pub(crate) fn open(domain: &Arc<Domain>, info: *mut sys::fi_info, cq: &Arc<Cq>, av: &Arc<Av>, rail: usize) -> Result<Endpoint> {
        let mut raw = ptr::null_mut();
        // SAFETY: domain live, info valid.
        let ret = unsafe { sys::nf_fi_endpoint(domain.raw, info, &mut raw, ptr::null_mut()) };
        if ret != 0 {
            return Err(fab_err("fi_endpoint", Some(rail), ret as i64));
        }
        let ep = Endpoint { raw, _parent: (cq.clone(), av.clone()) };
        let flags = (sys::FI_TRANSMIT | sys::FI_RECV) as u64;
        // SAFETY: ep, cq and av are live objects of the same domain.
        let ret = unsafe { sys::nf_fi_ep_bind_cq(ep.raw, cq.raw, flags) };
        if ret != 0 {
            return Err(fab_err("fi_ep_bind(cq)", Some(rail), ret as i64));
        }
        // SAFETY: as above.
        let ret = unsafe { sys::nf_fi_ep_bind_av(ep.raw, av.raw) };
        if ret != 0 {
            return Err(fab_err("fi_ep_bind(av)", Some(rail), ret as i64));
        }
        ep.remove_stale_shm_region(rail);
        // SAFETY: ep is bound and ready to enable.
        let ret = unsafe { sys::nf_fi_enable(ep.raw) };
        if ret != 0 {
            return Err(fab_err("fi_enable", Some(rail), ret as i64));
        }
        Ok(ep)
    }

    /// libfabric's shm (1.17 and 2.x) names an endpoint's region after the process id
    /// ("fi_shm://<pid>:<domain>:<ep>", a file in /dev/shm) and will not enable over an
    /// existing one (EBUSY). A process killed before closing its endpoints leaves its
    /// regions behind, and a later process that gets the same pid could not open its shm
    /// rail. Before enabling, a region under this endpoint's name is such a leftover (the
    /// provider gives each live endpoint of this process its own name, and this one is not
    /// enabled yet), so it is removed, but only in the initial pid namespace: in a nested one
    /// another namespace sharing /dev/shm may have a live process with the same pid.
    fn remove_stale_shm_region(&self, rail: usize) {
        let Ok(raw) = self.name(rail) else { return };
        let text = String::from_utf8_lossy(&raw);
        let Some(name) = text.trim_end_matches('\0').strip_prefix("fi_shm://") else { return };
        if name.is_empty() || name.contains('/') || !name.starts_with(&format!("{}:", std::process::id())) {
            return;
        }
        // In a nested pid namespace our pid is not unique on a /dev/shm shared with other
        // namespaces (containers of one pod): a region under our name may be a live one.
        if !in_initial_pid_namespace() {
            return;
        }
        let path = std::path::Path::new("/dev/shm").join(name);
        if std::fs::remove_file(&path).is_ok() {
            log::warn!("rail {rail}: removed {}, left by an exited process with this pid (it would keep the shm endpoint from opening)", path.display());
        }
    }

    pub(crate) fn name(&self, rail: usize) -> Result<Vec<u8>> {
        let mut buf = vec![0u8; 256];
        loop {
            let mut len = buf.len();
            // SAFETY: buf has len bytes of room.
            let ret = unsafe { sys::nf_fi_getname(self.raw, buf.as_mut_ptr() as *mut _, &mut len) };
            if ret == -(sys::FI_ETOOSMALL as i32) && len > buf.len() {
                buf.resize(len, 0);
                continue;
            }
            if ret != 0 {
                return Err(fab_err("fi_getname", Some(rail), ret as i64));
            }
            buf.truncate(len);
            return Ok(buf);
        }
    }
}

/// Whether this process's pid is its only one (/proc/self/status lists one NSpid level).
fn in_initial_pid_namespace() -> bool {
    std::fs::read_to_string("/proc/self/status").is_ok_and(|s| {
        s.lines().find_map(|l| l.strip_prefix("NSpid:")).is_some_and(|v| v.split_whitespace().count() == 1)
    })
}
