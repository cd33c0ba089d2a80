//! Hostile neighbours and least privilege: grants, resign requests, secrets,
//! squatted keys and TLS.

mod privileges;
mod resign;
mod secrets;
mod squatters;
mod tls;
