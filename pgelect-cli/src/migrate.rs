//! `pgelect migrate`.

use std::time::Duration;

use clap::Args;

use crate::cli::Global;
use crate::exit::Failure;

#[derive(Debug, Args)]
pub struct MigrateArgs {
    /// Wait at most this long for the migration lock (held by a concurrent
    /// `pgelect migrate`, or by any session that took its key), then exit 75
    /// naming who holds it.
    #[arg(long, value_parser = crate::duration::parse_positive, default_value = "30s", value_name = "DURATION", allow_hyphen_values = true)]
    pub timeout: Duration,
}

pub async fn run(global: &Global, args: MigrateArgs) -> Result<u8, Failure> {
    let options = global.connect_options()?;
    let applied = pgelect::schema::migrate_timeout(&options, args.timeout).await?;
    let schema = options.schema_name();
    if applied == 0 {
        println!(
            "schema {schema} is up to date (version {})",
            pgelect::schema::SCHEMA_VERSION
        );
    } else {
        println!(
            "schema {schema}: applied {applied} migration(s), now at version {}",
            pgelect::schema::SCHEMA_VERSION
        );
    }
    Ok(0)
}
