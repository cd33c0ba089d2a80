//! The schema: migrations, and what older server versions lack.

mod migrations;
mod server_versions;
