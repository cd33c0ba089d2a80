//! `pgelect migrate`.

use clap::Args;

use crate::cli::Global;
use crate::exit::Failure;

#[derive(Debug, Args)]
pub struct MigrateArgs {}

pub async fn run(global: &Global, _args: MigrateArgs) -> Result<u8, Failure> {
    let options = global.connect_options()?;
    let applied = pgelect::migrate(&options).await?;
    let schema = options.schema_name();
    if applied == 0 {
        println!(
            "schema {schema} is up to date (version {})",
            pgelect::SCHEMA_VERSION
        );
    } else {
        println!(
            "schema {schema}: applied {applied} migration(s), now at version {}",
            pgelect::SCHEMA_VERSION
        );
    }
    Ok(0)
}
