//! What the server supports, by major version.
//!
//! pgelect is tested on PostgreSQL 13 to 18. It needs nothing newer than 13
//! to be safe; a few settings that make it faster to notice a dead peer came
//! later. Rather than fail on an older server, pgelect skips what the server
//! lacks (the session settings are joined with `pg_settings`) and says so,
//! once per process and major version, here. The version is the
//! `server_version` the server reports at startup, so this costs no round
//! trip.

use std::sync::Mutex;

/// The oldest major version pgelect is tested on.
pub(crate) const OLDEST_TESTED: u32 = 13;

/// The major version in a `server_version` string: `"13.23"`,
/// `"18.4 (Debian 18.4-1.pgdg120+1)"`, `"17devel"`, `"16beta1"`, `"9.6.24"`
/// (major 9: the minor of the old numbering is ignored).
pub(crate) fn major_version(server_version: &str) -> Option<u32> {
    let digits: String = server_version
        .trim_start()
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok().filter(|m| *m > 0)
}

/// What pgelect does without on a server of this major version, each with
/// its consequence; empty when nothing is missing.
pub(crate) fn degraded(major: u32) -> Vec<String> {
    let mut out = Vec::new();
    if major < OLDEST_TESTED {
        out.push(format!(
            "PostgreSQL {major} is older than {OLDEST_TESTED}, the oldest version pgelect is tested on"
        ));
    }
    if major < 14 {
        out.push(
            "client_connection_check_interval (PostgreSQL 14+) is unavailable: a backend \
             waiting for a lock notices that its client died only when the wait ends (at the \
             end of a wait slice for a blocking standby, when granted for a lock session), so a \
             dead waiter may stay queued that long and is then let go at once; who leads and \
             who holds a lock are unaffected"
                .to_owned(),
        );
    }
    out
}

/// Logs, once per process and major version, what pgelect does without on
/// the server that reported `server_version` (see [`degraded`]).
pub(crate) fn note_version(server_version: Option<&str>) {
    static NOTED: Mutex<Vec<u32>> = Mutex::new(Vec::new());
    let Some(version) = server_version else {
        return;
    };
    let Some(major) = major_version(version) else {
        tracing::debug!(server_version = version, "unrecognised server_version");
        return;
    };
    let gaps = degraded(major);
    if gaps.is_empty() {
        return;
    }
    {
        let mut noted = NOTED.lock().unwrap_or_else(|e| e.into_inner());
        if noted.contains(&major) {
            return;
        }
        noted.push(major);
    }
    for gap in gaps {
        if major < OLDEST_TESTED {
            tracing::warn!(server_version = version, "pgelect degraded: {gap}");
        } else {
            tracing::info!(server_version = version, "pgelect degraded: {gap}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn major_versions_are_read_from_what_servers_report() {
        assert_eq!(major_version("13.23"), Some(13));
        assert_eq!(major_version("18.4 (Debian 18.4-1.pgdg120+1)"), Some(18));
        assert_eq!(major_version("15.18 (Debian 15.18-0+deb12u1)"), Some(15));
        assert_eq!(major_version("17devel"), Some(17));
        assert_eq!(major_version("16beta1"), Some(16));
        assert_eq!(major_version("9.6.24"), Some(9));
        assert_eq!(major_version(""), None);
        assert_eq!(major_version("devel"), None);
    }

    #[test]
    fn only_servers_before_14_lack_something() {
        assert!(degraded(14).is_empty());
        assert!(degraded(18).is_empty());
        let d13 = degraded(13);
        assert_eq!(d13.len(), 1);
        assert!(
            d13[0].contains("client_connection_check_interval"),
            "{d13:?}"
        );
        let d12 = degraded(12);
        assert_eq!(d12.len(), 2);
        assert!(d12[0].contains("oldest version"), "{d12:?}");
    }
}
