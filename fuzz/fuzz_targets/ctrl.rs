//! Fuzzes decode_ctrl (every message received on rail 0), then the payload decoder its type
//! selects: HELLO -> ConnInfo::decode, STAGE -> Stage::decode, STAGE_ACK -> StageAck::decode
//! (NOTIF and KICK payloads are opaque).
//! Stage and StageAck decoding is also run on every payload whatever the type, so those
//! decoders see arbitrary bytes too.
//! Properties: never panics; accepted messages and payloads re-encode to the same bytes
//! (ConnInfo: except its ignored flags field).
#![no_main]

use libfuzzer_sys::fuzz_target;
use nixl_fabric::engine::wire::{decode_ctrl, encode_ctrl, ConnInfo, CtrlType, Stage, StageAck};

fn stage(p: &[u8]) -> bool {
    match Stage::decode(p) {
        Ok(s) => {
            assert_eq!(s.encode(), p, "accepted stage request does not re-encode to its bytes");
            assert!(s.dev_addr.checked_add(s.len).is_some() && s.peer_addr.checked_add(s.len).is_some());
            true
        }
        Err(_) => false,
    }
}

fn stage_ack(p: &[u8]) -> bool {
    match StageAck::decode(p) {
        Ok(a) => {
            assert_eq!(a.encode(), p, "accepted stage answer does not re-encode to its bytes");
            true
        }
        Err(_) => false,
    }
}

fuzz_target!(|data: &[u8]| {
    // The payload decoders on their own (the fuzzer's bytes as a payload).
    let _ = stage(data);
    let _ = stage_ack(data);
    let Ok(c) = decode_ctrl(data) else { return };
    assert_eq!(encode_ctrl(c.kind, c.sender_id, c.sender, c.payload), data, "accepted control message does not re-encode");
    match c.kind {
        CtrlType::Hello => {
            if let Ok(ci) = ConnInfo::decode(c.payload) {
                let mut want = c.payload.to_vec();
                want[6] = 0;
                want[7] = 0;
                assert_eq!(ci.encode(), want);
            }
        }
        CtrlType::Notif => {}
        CtrlType::Stage => {
            let _ = stage(c.payload);
        }
        CtrlType::StageAck => {
            let _ = stage_ack(c.payload);
        }
        // KICK: no payload to decode (the engine ignores it); types added later likewise
        // until they get an arm here.
        #[allow(unreachable_patterns)]
        _ => {}
    }
});
