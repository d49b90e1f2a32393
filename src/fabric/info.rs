//! Provider discovery: which fi_info entries become rails.
use super::sys;
use super::{api_version, fab_err, library_major};
use crate::config::Config;
use crate::error::{Error, Result};
use std::ffi::{CStr, CString};
use std::ptr;

/// One fi_info entry chosen to become a rail. Owns a duplicate of the entry.
pub struct RailSpec {
    pub(super) info: *mut sys::fi_info,
    pub prov_name: String,
    pub domain_name: String,
    pub fabric_name: String,
    /// Whether delivery-complete was granted in the hints (else completions are only
    /// transmit-complete and writes need an explicit flush).
    pub delivery_complete: bool,
    /// Provider faults to inject on rails opened from this entry (config `fault_inject`).
    pub(crate) fault: Option<super::FaultSpec>,
    /// The libfabric API version the entry was asked for (and its fabric opens with).
    pub api_version: u32,
}

// SAFETY: the fi_info copy is owned and only read after construction.
unsafe impl Send for RailSpec {}
unsafe impl Sync for RailSpec {}

impl Drop for RailSpec {
    fn drop(&mut self) {
        // SAFETY: info came from fi_dupinfo and is freed exactly once here.
        unsafe { sys::fi_freeinfo(self.info) }
    }
}

impl Clone for RailSpec {
    fn clone(&self) -> Self {
        // SAFETY: fi_dupinfo deep-copies a valid info.
        let info = unsafe { sys::fi_dupinfo(self.info) };
        RailSpec {
            info,
            prov_name: self.prov_name.clone(),
            domain_name: self.domain_name.clone(),
            fabric_name: self.fabric_name.clone(),
            delivery_complete: self.delivery_complete,
            fault: self.fault.clone(),
            api_version: self.api_version,
        }
    }
}

/// Maps the user's short provider names onto libfabric's.
fn provider_candidates(name: &str) -> Vec<&str> {
    match name {
        "auto" | "" => vec!["efa", "verbs;ofi_rxm", "tcp;ofi_rxm", "sockets"],
        "tcp" => vec!["tcp;ofi_rxm"],
        "udp" => vec!["udp;ofi_rxd"],
        "verbs" => vec!["verbs;ofi_rxm"],
        other => vec![other],
    }
}

fn cstr_field(p: *const std::os::raw::c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: libfabric strings in fi_info are NUL-terminated.
    unsafe { CStr::from_ptr(p).to_string_lossy().into_owned() }
}

/// Owned fi_getinfo result list.
struct InfoList(*mut sys::fi_info);
impl Drop for InfoList {
    fn drop(&mut self) {
        if !self.0.is_null() {
            // SAFETY: list came from fi_getinfo and is freed once.
            unsafe { sys::fi_freeinfo(self.0) }
        }
    }
}

/// Hints asking for an RDM endpoint with RMA and messages, and the mr_mode bits we can
/// honour, so the provider picks its own preferred mode among them.
fn getinfo(prov: &str, delivery_complete: bool, hmem: bool) -> Result<InfoList> {
    getinfo_ordered(prov, delivery_complete, hmem, false)
}

/// `raw`: also ask that reads be ordered after earlier writes (FI_ORDER_RAW), which lets
/// the engine confirm delivery with one small read instead of delivery-complete writes, and
/// where the provider grants it that a send be ordered after earlier writes (FI_ORDER_SAW),
/// which lets a notification follow its data at once (RailCaps::order_saw). A provider that
/// cannot order sends after writes answers the same hints without SAW.
fn getinfo_ordered(prov: &str, delivery_complete: bool, hmem: bool, raw: bool) -> Result<InfoList> {
    if !raw {
        return getinfo_order(prov, delivery_complete, hmem, 0);
    }
    let sas_raw = (sys::FI_ORDER_RAW | sys::FI_ORDER_SAS) as u64;
    getinfo_order(prov, delivery_complete, hmem, sas_raw | sys::FI_ORDER_SAW as u64)
        .or_else(|_| getinfo_order(prov, delivery_complete, hmem, sas_raw))
}

/// fi_getinfo with our hints and `msg_order` asked of the transmit side (0: nothing).
fn getinfo_order(prov: &str, delivery_complete: bool, hmem: bool, msg_order: u64) -> Result<InfoList> {
    // SAFETY: fi_allocinfo returns a zeroed info with allocated sub-attributes (or NULL).
    let hints = unsafe { sys::nf_fi_allocinfo() };
    if hints.is_null() {
        return Err(Error::Backend("fi_allocinfo returned NULL".into()));
    }
    let hints = InfoList(hints);
    let cprov = CString::new(prov).map_err(|_| Error::InvalidParam("provider name has NUL".into()))?;
    // SAFETY: hints and its attribute structs were allocated by fi_allocinfo; strdup'ed
    // strings are freed by fi_freeinfo.
    unsafe {
        let h = &mut *hints.0;
        h.caps = (sys::FI_MSG | sys::FI_RMA | sys::FI_READ | sys::FI_WRITE | sys::FI_REMOTE_READ
            | sys::FI_REMOTE_WRITE | sys::FI_SEND | sys::FI_RECV) as u64;
        h.mode = sys::FI_CONTEXT | sys::FI_CONTEXT2;
        (*h.ep_attr).type_ = sys::fi_ep_type_FI_EP_RDM;
        let d = &mut *h.domain_attr;
        d.mr_mode = (sys::FI_MR_LOCAL | sys::FI_MR_VIRT_ADDR | sys::FI_MR_ALLOCATED
            | sys::FI_MR_PROV_KEY) as i32;
        if hmem {
            h.caps |= sys::FI_HMEM;
            d.mr_mode |= sys::FI_MR_HMEM as i32;
        }
        d.threading = sys::fi_threading_FI_THREAD_DOMAIN;
        d.av_type = sys::fi_av_type_FI_AV_TABLE;
        if delivery_complete {
            (*h.tx_attr).op_flags = sys::FI_DELIVERY_COMPLETE as u64;
        }
        (*h.tx_attr).msg_order = msg_order;
        (*h.fabric_attr).prov_name = libc::strdup(cprov.as_ptr());
    }
    let mut out: *mut sys::fi_info = ptr::null_mut();
    // SAFETY: hints is valid; out receives a list we own.
    let ret = unsafe { sys::fi_getinfo(api_version(hmem), ptr::null(), ptr::null(), 0, hints.0, &mut out) };
    if ret != 0 {
        return Err(fab_err("fi_getinfo", None, ret as i64));
    }
    Ok(InfoList(out))
}

/// A list entry turned into plain strings, for filtering and diagnostics.
fn describe(p: *mut sys::fi_info) -> (String, String, String, u32) {
    // SAFETY: p is an element of a live fi_getinfo list.
    unsafe {
        let i = &*p;
        (
            cstr_field((*i.fabric_attr).prov_name),
            cstr_field((*i.domain_attr).name),
            cstr_field((*i.fabric_attr).name),
            i.addr_format,
        )
    }
}

/// Chooses the rails for a configuration: the first provider (in preference order) with
/// any matching domain wins; one entry per domain, IPv4 preferred.
/// `want_hmem` (the caller found a CUDA driver) asks for FI_HMEM first, so providers that
/// can register device memory are picked in that mode; without it, or where the provider
/// cannot, rails are plain and device memory is staged.
pub fn discover(cfg: &Config, want_hmem: bool) -> Result<Vec<RailSpec>> {
    let fault = super::FaultSpec::parse(&cfg.fault_inject)?;
    // shm has one domain and no interfaces: an interface list (often set for the network
    // providers, e.g. NIXL_FABRIC_IFACE=lo) does not apply to it.
    let wanted: Vec<String> = if cfg.provider == "shm" {
        Vec::new()
    } else {
        cfg.iface.split(',').map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect()
    };
    let mut last_err = None;
    for prov in provider_candidates(&cfg.provider) {
        // libfabric 1.x's shm copies in the posting call when the domain asks for no RMA
        // ordering and no delivery-complete (its fast RMA, see RailCaps::sync_rma); the
        // other shm modes route every operation through the peer's progress.
        let shm_fast = prov == "shm" && library_major() == 1;
        let modes: &[(bool, bool, bool)] = match (want_hmem, shm_fast) {
            (true, false) => &[(true, true, true), (true, true, false), (true, false, false), (false, true, true), (false, true, false), (false, false, false)],
            (true, true) => &[(true, true, true), (true, true, false), (true, false, false), (false, false, false), (false, true, true), (false, true, false)],
            (false, false) => &[(false, true, true), (false, true, false), (false, false, false)],
            (false, true) => &[(false, false, false), (false, true, true), (false, true, false)],
        };
        for &(hmem, dc, raw) in modes {
            let list = match getinfo_ordered(prov, dc, hmem, raw) {
                Ok(l) => l,
                Err(e) => {
                    last_err = Some(Error::NotFound(format!("provider '{prov}' is not available: {e}")));
                    continue;
                }
            };
            let mut picked: Vec<(*mut sys::fi_info, String, String, String, u32)> = Vec::new();
            let mut p = list.0;
            while !p.is_null() {
                let (pn, dn, fname, af) = describe(p);
                let wanted_ok = if wanted.is_empty() {
                    // Without a list, prefer real interfaces; loopback only when it is all.
                    true
                } else {
                    wanted.contains(&dn)
                };
                if wanted_ok {
                    let ipv4 = af == sys::FI_SOCKADDR_IN;
                    match picked.iter_mut().find(|e| e.2 == dn) {
                        Some(e) if ipv4 && e.4 != sys::FI_SOCKADDR_IN => *e = (p, pn, dn, fname, af),
                        Some(_) => {}
                        None => picked.push((p, pn, dn, fname, af)),
                    }
                }
                // SAFETY: walking the list we own.
                p = unsafe { (*p).next };
            }
            if wanted.is_empty() && picked.iter().any(|e| e.2 != "lo") {
                picked.retain(|e| e.2 != "lo");
            }
            if picked.is_empty() {
                last_err = Some(Error::NotFound(format!(
                    "provider {prov} has no domain matching iface '{}'",
                    cfg.iface
                )));
                continue;
            }
            let mut specs = Vec::new();
            for (p, pn, dn, fname, _) in picked {
                // SAFETY: p is a live list element; dupinfo copies it (next is not copied).
                let dup = unsafe { sys::fi_dupinfo(p) };
                if dup.is_null() {
                    return Err(Error::Backend("fi_dupinfo returned NULL".into()));
                }
                specs.push(RailSpec { info: dup, prov_name: pn, domain_name: dn, fabric_name: fname, delivery_complete: dc, fault: fault.clone(), api_version: api_version(hmem) });
            }
            return Ok(specs);
        }
    }
    Err(last_err.unwrap_or_else(|| Error::NotFound(format!("no provider for '{}'", cfg.provider))))
}

/// What `nixl-fabric-info` prints for one provider entry.
pub struct ProviderSummary {
    pub prov_name: String,
    pub domain: String,
    pub fabric: String,
    pub rma: bool,
    pub hmem: bool,
    pub cq_data_size: u64,
    pub mr_mode: i32,
}

/// Every RDM provider entry that offers RMA and messages, for diagnostics.
pub fn provider_list() -> Vec<ProviderSummary> {
    let mut v = Vec::new();
    for prov in ["efa", "verbs;ofi_rxm", "tcp;ofi_rxm", "sockets", "shm", "udp;ofi_rxd"] {
        let Ok(list) = getinfo(prov, false, false) else { continue };
        let mut p = list.0;
        while !p.is_null() {
            let (pn, dn, fname, _) = describe(p);
            // SAFETY: p is a live list element.
            unsafe {
                let i = &*p;
                let dup = v.iter().any(|x: &ProviderSummary| x.prov_name == pn && x.domain == dn && x.fabric == fname);
                if dup {
                    p = i.next;
                    continue;
                }
                v.push(ProviderSummary {
                    prov_name: pn,
                    domain: dn,
                    fabric: fname,
                    rma: i.caps & sys::FI_RMA as u64 != 0,
                    hmem: i.caps & sys::FI_HMEM != 0,
                    cq_data_size: (*i.domain_attr).cq_data_size as u64,
                    mr_mode: (*i.domain_attr).mr_mode,
                });
                p = i.next;
            }
        }
    }
    v
}
