//! A confirmation body as the producer's listeners receive it.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| outbox::fuzzing::confirmations(data));
