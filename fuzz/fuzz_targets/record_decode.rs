#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| effectively_once_fuzz::record_decode(data));
