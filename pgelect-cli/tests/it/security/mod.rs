//! The command among hostile neighbours: grants, resign authentication,
//! secrets, squatted keys and TLS.

mod grants;
mod resign;
mod secrets;
mod squatters;
mod tls;
