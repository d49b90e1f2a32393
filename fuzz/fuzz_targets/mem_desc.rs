//! Fuzzes MemDesc::decode (a peer's public memory descriptor, `nf_rmem_load`).
//! Property: never panics; an accepted blob re-encodes to exactly the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nixl_fabric::engine::wire::MemDesc;

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = MemDesc::decode(data) {
        let enc = m.encode();
        assert_eq!(enc, data, "accepted memory descriptor does not re-encode to its bytes");
        assert!(m.base.checked_add(m.len).is_some(), "accepted base + length overflow");
        assert!(!m.keys.is_empty() && m.keys.len() <= nixl_fabric::engine::wire::MAX_RAILS);
    }
});
