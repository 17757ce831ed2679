#![no_main]
//! memcached's ASCII authentication parser and the SASL PLAIN decoder: any
//! bytes give an answer within the buffer, and every strict prefix of an
//! answered buffer waits or gives the same answer.
use libfuzzer_sys::fuzz_target;
use mbal_proto::auth::{parse_ascii_auth, sasl_plain, AsciiAuth, MAX_AUTH_LINE, MAX_AUTH_TOKEN};

fuzz_target!(|data: &[u8]| {
    let _ = sasl_plain(data);
    let full = parse_ascii_auth(data);
    match full {
        AsciiAuth::NeedMore => assert!(data.len() <= MAX_AUTH_LINE + MAX_AUTH_TOKEN + 2 + MAX_AUTH_LINE),
        AsciiAuth::Close => assert!(data.len() > MAX_AUTH_LINE),
        AsciiAuth::Refuse { consumed, .. } | AsciiAuth::Creds { consumed, .. } => {
            assert!(consumed > 0 && consumed <= data.len());
            for i in 0..consumed {
                let pre = parse_ascii_auth(&data[..i]);
                assert!(pre == AsciiAuth::NeedMore || pre == AsciiAuth::Close || pre == full, "prefix {i}");
            }
        }
    }
});
