//! `pgelect resign`: ask a role's leader to step down, and see it happen.

use std::time::{Duration, Instant};

use clap::Args;
use pgelect::admin::AdminClient;

use crate::cli::Global;
use crate::exit::{self, Failure};
use crate::status::escape;

/// A role name in double quotes, as `status` escapes it (checked names hold
/// no control character, but the quotes and backslashes are escaped alike).
fn quoted(role: &str) -> String {
    format!("\"{}\"", escape(role).replace('"', "\\\""))
}

#[derive(Debug, Args)]
pub struct ResignArgs {
    /// The role whose leader should step down.
    #[arg(long, value_name = "ROLE")]
    pub role: String,
    /// Give up waiting for a new term after this long (exit 75).
    #[arg(long, value_parser = crate::duration::parse_positive, default_value = "30s", value_name = "DURATION", allow_hyphen_values = true)]
    pub timeout: Duration,
}

pub async fn run(global: &Global, args: ResignArgs) -> Result<u8, Failure> {
    crate::run::check_name("--role", &args.role)?;
    let options = global.connect_options()?;
    let schema = options.schema_name().as_str().to_owned();
    // Listens for changes from the start: none is missed.
    let mut admin = AdminClient::connect(&options).await?;
    let started = Instant::now();
    // The database authenticates the request: only users granted EXECUTE
    // on the schema's request_resign may make it.
    let asked = match admin.request_resign(&args.role).await {
        Ok(asked) => asked,
        Err(e @ pgelect::Error::Permission { .. }) => {
            let mut failure = Failure::from(e);
            failure.message.push_str(&format!(
                "; ask the database owner for: GRANT USAGE ON SCHEMA {schema} TO <you>; GRANT EXECUTE ON FUNCTION {schema}.request_resign(text) TO <you>; GRANT SELECT ON {schema}.leaders TO <you> (to see the new term)"
            ));
            return Err(failure);
        }
        Err(e) => return Err(e.into()),
    };
    let Some(asked) = asked else {
        let term = match admin.lease_row(&args.role).await? {
            Some(row) => row.term,
            // No row: an unknown role (exit 66, naming the known ones), or
            // one whose lock is taken before anyone was elected.
            None => admin.role(&args.role).await?.term,
        };
        // Nothing was asked: a script must not take this for a hand-over.
        return Err(Failure::new(
            exit::TEMPFAIL,
            format!(
                "role {} has no leader (last term {term}); nothing to resign: see `pgelect status --role {}`",
                quoted(&args.role),
                escape(&args.role)
            ),
        ));
    };
    let old_term = asked.term;
    println!(
        "asked {} (term {old_term}) to resign role {}; waiting for a change of term",
        escape(&asked.holder),
        quoted(&args.role)
    );
    let deadline = tokio::time::Instant::now() + args.timeout;
    let mut said_released = false;
    // Nothing has changed yet: the leader acts on the request once it
    // committed, and a read now would only take the server's time from the
    // handover. Changes since the connection are kept for `changed`.
    let mut asked_just_now = true;
    loop {
        if std::mem::take(&mut asked_just_now) {
        } else if let Some(row) = admin.lease_row(&args.role).await? {
            let (term, holder) = (row.term, row.holder);
            if term != old_term {
                // Alone, a `pgelect run` leader stands again at once and wins:
                // a new term, but leadership did not move. Say so.
                let same = holder.as_deref() == Some(asked.holder.as_str());
                println!(
                    "role {} is now led by {} with term {term} ({} ms after the request){}",
                    quoted(&args.role),
                    holder
                        .as_deref()
                        .map_or_else(|| "(nobody yet)".to_owned(), escape),
                    started.elapsed().as_millis(),
                    if same {
                        "; the same node was re-elected: no other candidate was waiting"
                    } else {
                        ""
                    }
                );
                return Ok(0);
            }
            if holder.is_none() && !said_released {
                said_released = true;
                println!(
                    "leader released role {} ({} ms after the request); no candidate has taken it yet",
                    quoted(&args.role),
                    started.elapsed().as_millis()
                );
            }
        }
        // Woken by the leader's NOTIFY; the short tick covers a missed one.
        tokio::select! {
            changed = admin.changed() => if changed.is_err() {
                return Err(Failure::new(exit::UNAVAILABLE, "the database connection ended while waiting"));
            },
            _ = tokio::time::sleep(Duration::from_millis(250)) => {}
            _ = tokio::time::sleep_until(deadline) => {
                return Err(Failure::new(exit::TEMPFAIL, format!(
                    "no new term for role {} within {}: the leader may not be listening (is it a pgelect leader?), or no standby is waiting",
                    quoted(&args.role), crate::duration::show(args.timeout))));
            }
        }
    }
}
