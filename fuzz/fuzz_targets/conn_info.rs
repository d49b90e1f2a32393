//! Fuzzes ConnInfo::decode (a peer's connection info, `nf_engine_load_conn_info`).
//! Property: never panics; an accepted blob re-encodes to the same bytes, except the flags
//! field (bytes 6..8), which version 1 ignores and encode() writes as 0.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nixl_fabric::engine::wire::ConnInfo;

fuzz_target!(|data: &[u8]| {
    if let Ok(c) = ConnInfo::decode(data) {
        let enc = c.encode();
        let mut want = data.to_vec();
        want[6] = 0;
        want[7] = 0;
        assert_eq!(enc, want, "accepted connection info does not re-encode to its bytes");
        assert_eq!(ConnInfo::decode(&enc).expect("re-encoded connection info rejected"), c);
    }
});
