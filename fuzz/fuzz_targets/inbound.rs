//! A delivery as each consumer receives it: the webhook receiver (signature included), Redis
//! Streams fields, RabbitMQ header tables, MQTT packets (`outbox::fuzzing::inbound`).
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| outbox::fuzzing::inbound_bytes(data));
