//! Inputs found by the fuzzers, kept as tests.

use mbal_proto::{parse, Limits, Parsed, Protocol};

/// fuzz_meta, 2026-11-22: an `ms` waiting for its data block may hold more
/// than `max_line` bytes (its line plus part of the data): that is
/// NeedMore, bounded by the item size, not an error.
#[test]
fn ms_waiting_for_data_longer_than_max_line_is_need_more() {
    let limits = Limits { max_item_size: 65, max_line: 20 };
    let mut buf = b"ms ! 52\n \n!01\n".to_vec();
    buf.extend(std::iter::repeat_n(0u8, 30));
    assert!(buf.len() > limits.max_line);
    assert!(matches!(parse(Protocol::Text, &buf, &limits), Parsed::NeedMore));
    // With the whole data block it parses.
    buf.truncate(8);
    buf.extend(std::iter::repeat_n(b'x', 52));
    buf.extend_from_slice(b"\r\n");
    assert!(matches!(parse(Protocol::Text, &buf, &limits), Parsed::Req { consumed, .. } if consumed == buf.len()));
}
