#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| effectively_once_fuzz::retry_after(data));
