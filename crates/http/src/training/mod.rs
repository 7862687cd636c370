//! The training API's routes over the training service (`temper_train::service`): wire types
//! and `Idempotency-Key`s; adapters exported and imported.

pub mod adapters;
pub mod idempotency;
pub mod routes;
pub mod wire;
