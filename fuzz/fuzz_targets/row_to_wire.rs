//! A row written by plain SQL, through the store's header parsing and every broker's check and
//! encoder (`outbox::fuzzing::row_to_wire`).
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| outbox::fuzzing::row_to_wire_bytes(data));
