//! The two C symbols the NIXL plugin manager looks up in `libplugin_<NAME>.so`
//! (`nixl_plugin_init`, `nixl_plugin_fini`; ABI doc §2.2). They forward to the C++ adapter
//! (src/adapter/plugin_entry.cpp), whose own functions have hidden visibility: the cdylib's
//! version script exports only Rust `#[no_mangle]` symbols, so the exports live here.
//!
//! None of this belongs to the C ABI of include/nixl_fabric.h, so every item carries the
//! `cbindgen:ignore` doc line that keeps cbindgen from copying it into the header.
use std::ffi::c_void;
use std::panic::catch_unwind;

use adapter::{nf_adapter_plugin_fini, nf_adapter_plugin_init};

/// The C++ side (src/adapter/plugin_entry.h).
///
/// cbindgen:ignore
mod adapter {
    use std::ffi::c_void;

    extern "C" {
        /// The adapter's static plugin descriptor (`nixlBackendPlugin`, api_version 1).
        pub fn nf_adapter_plugin_init() -> *mut c_void;
        /// Releases nothing (the descriptor is static; engines are freed by the agent).
        pub fn nf_adapter_plugin_fini();
        /// 0 when every engine method sits in its ABI vtable slot, else the first wrong slot.
        #[cfg(test)]
        pub fn nf_adapter_check_layout() -> i32;
    }
}

/// Entry point of the plugin: a pointer to the plugin descriptor. The manager may call it
/// more than once per process (temporary loads for `getPluginParams`); every call returns
/// the same static descriptor. NULL (a failed load) only if something panicked.
///
/// cbindgen:ignore
#[no_mangle]
pub extern "C" fn nixl_plugin_init() -> *mut c_void {
    // SAFETY: nf_adapter_plugin_init takes no arguments, cannot throw (so no C++ exception
    // unwinds into Rust) and only returns the address of a static object.
    catch_unwind(|| unsafe { nf_adapter_plugin_init() }).unwrap_or(std::ptr::null_mut())
}

/// Called by the manager when it releases the plugin (at process exit, or after a
/// temporary load). Nothing is torn down: the image is RTLD_NODELETE and its statics stay.
///
/// cbindgen:ignore
#[no_mangle]
pub extern "C" fn nixl_plugin_fini() {
    // SAFETY: nf_adapter_plugin_fini takes no arguments, cannot throw and touches no state.
    let _ = catch_unwind(|| unsafe { nf_adapter_plugin_fini() });
}

#[cfg(test)]
mod tests {
    use super::adapter::nf_adapter_check_layout;
    use super::*;

    #[test]
    fn vtable_slots_match_the_abi() {
        // SAFETY: a C++ function without arguments that cannot throw; it only decodes
        // member-function pointers.
        let bad = unsafe { nf_adapter_check_layout() };
        assert_eq!(
            bad, 0,
            "engine method in the wrong vtable slot: {bad} (ABI doc §5.2)"
        );
    }

    #[test]
    fn init_returns_one_static_descriptor() {
        let a = nixl_plugin_init();
        nixl_plugin_fini();
        let b = nixl_plugin_init();
        assert!(!a.is_null());
        assert_eq!(a, b);
        // SAFETY: the descriptor starts with `int api_version` (ABI doc §3) and is static.
        assert_eq!(unsafe { *(a as *const i32) }, 1);
        nixl_plugin_fini();
    }
}
