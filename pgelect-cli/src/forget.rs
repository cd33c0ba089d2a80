//! `pgelect forget`: remove a role nobody holds or stands for; the library
//! decides ([`pgelect::admin::AdminClient::forget`]), this says what it did.

use clap::Args;
use pgelect::admin::{AdminClient, ForgetOutcome};

use crate::cli::Global;
use crate::exit::{self, Failure};
use crate::status::escape;

#[derive(Debug, Args)]
pub struct ForgetArgs {
    /// The role to remove from the leaders table.
    #[arg(long, value_name = "ROLE")]
    pub role: String,
}

pub async fn run(global: &Global, args: ForgetArgs) -> Result<u8, Failure> {
    crate::run::check_name("--role", &args.role)?;
    let options = global.connect_options()?;
    let mut admin = AdminClient::connect(&options).await?;
    let role = args.role.as_str();
    let quoted = format!("\"{}\"", escape(role));
    let refuse = |why: String| {
        Failure::new(
            exit::TEMPFAIL,
            format!("role {quoted} not removed: {why}; stop its candidates (pgelect run --role {}) first, then run forget again", escape(role)),
        )
    };
    match admin.forget(role).await? {
        ForgetOutcome::Forgotten { last_term } => {
            println!(
                "forgot role {quoted}: it is no longer listed; its last term {last_term} is kept, so a candidate that stands for it again continues above it (fencing terms never repeat)"
            );
            Ok(0)
        }
        ForgetOutcome::Led {
            holder,
            term,
            lease_until,
        } => Err(refuse(format!(
            "{} leads it with term {term}, lease live until {}",
            escape(&holder),
            lease_until.map_or_else(|| "?".to_owned(), crate::status::utc)
        ))),
        ForgetOutcome::Locked { sessions } if sessions.is_empty() => {
            Err(refuse("its lock is held by another session".to_owned()))
        }
        ForgetOutcome::Locked { sessions } => {
            let list: Vec<String> = sessions
                .iter()
                .map(|s| {
                    format!(
                        "{} by backend pid {}{}",
                        if s.granted { "held" } else { "waited for" },
                        s.backend_pid,
                        s.application_name
                            .as_deref()
                            .map(|a| format!(" ({})", escape(a)))
                            .unwrap_or_default()
                    )
                })
                .collect();
            Err(refuse(format!("its lock is {}", list.join(", "))))
        }
        ForgetOutcome::Standing { candidates } => {
            let list: Vec<String> = candidates
                .iter()
                .map(|c| format!("{} (backend pid {})", escape(&c.node), c.backend_pid))
                .collect();
            Err(refuse(format!(
                "candidates stand for it: {}",
                list.join(", ")
            )))
        }
        other => Err(Failure::new(
            exit::SOFTWARE,
            format!("role {quoted}: unexpected outcome {other:?}"),
        )),
    }
}
