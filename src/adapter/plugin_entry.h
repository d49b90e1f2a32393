// Hidden C entry points of the adapter, called from Rust (src/plugin.rs). Only the Rust
// wrappers nixl_plugin_init / nixl_plugin_fini are exported from the plugin. None of them
// can throw (they allocate nothing); they carry no noexcept so that these declarations stay
// compatible with any C-style declaration of the same names.
#pragma once

#define NF_ADAPTER_HIDDEN __attribute__((visibility("hidden")))

#include <stddef.h>


#ifdef __cplusplus
extern "C" {
#endif

// The plugin descriptor (static storage; the same pointer on every call).
NF_ADAPTER_HIDDEN void *nf_adapter_plugin_init(void);

// Nothing to release: the descriptor is static and engines are destroyed by the agent.
NF_ADAPTER_HIDDEN void nf_adapter_plugin_fini(void);

// What the layout detector (host_nixl.h) makes of the NIXL libraries mapped in this process
// now: one line into buf, and the layout (0 unknown, 1 0.7-0.9, 2 0.10, 3 1.x).
NF_ADAPTER_HIDDEN int nf_adapter_host_report(char *buf, size_t len);

// Self-check of the declarations in nixl_abi.h that static_assert cannot see: returns 0
// when every engine method sits in the vtable slot of ABI doc §5.2, else the first wrong
// slot number (for the Rust unit test in src/plugin.rs).
NF_ADAPTER_HIDDEN int nf_adapter_check_layout(void);

#ifdef __cplusplus
}
#endif
