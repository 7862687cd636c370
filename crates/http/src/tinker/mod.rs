//! The Tinker training API (`/api/v1/...`) that the `tinker` SDK 0.38.0 calls unchanged: sessions,
//! LoRA training runs driven step by step (`forward_backward` with a built-in loss, `optim_step`
//! with Adam), sampler weights saved as ordinary temper checkpoints (served by name), sampling
//! through temper's engine, and the futures protocol. Auth is temper's team keys (the SDK sends
//! `X-API-Key`); every object is its team's.

pub mod proto;
pub mod registry;
pub mod routes;
pub mod wire;

pub use registry::Tinker;
