//! libpq's password file (`PGPASSFILE`, else `~/.pgpass`).
//!
//! Format and matching follow libpq (`passwordFromFile` and
//! `pwdfMatchesString` in `fe-connect.c`): one entry per line,
//! `hostname:port:database:username:password`; a field that is exactly `*`
//! matches anything; `\:` and `\\` stand for `:` and `\`; lines starting with
//! `#` are comments; the first matching line wins. An empty host, or a Unix
//! socket directory that is a usual libpq default, is looked up as
//! `localhost`. On Unix the file is ignored, with a warning, unless it is a
//! plain file without group or world permissions (as libpq does).

use std::fs;
use std::io::{self, Read};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// What a connection is looked up by.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Lookup<'a> {
    pub(crate) host: &'a str,
    pub(crate) port: u16,
    pub(crate) database: &'a str,
    pub(crate) user: &'a str,
}

/// Socket directories libpq builds use as their compiled-in default
/// (`DEFAULT_PGSOCKET_DIR`: `/tmp` upstream, `/var/run/postgresql` on Debian
/// and Red Hat): libpq looks such a host up as `localhost`.
const DEFAULT_SOCKET_DIRS: [&str; 3] = ["/tmp", "/var/run/postgresql", "/run/postgresql"];

/// The file libpq would read: `PGPASSFILE` if set and non-empty, else
/// `.pgpass` in the home directory (`HOME`, else the home directory
/// `/etc/passwd` gives the effective user).
pub(crate) fn default_path() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("PGPASSFILE").filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(p));
    }
    home_dir().map(|home| home.join(".pgpass"))
}

fn home_dir() -> Option<PathBuf> {
    if let Some(h) = std::env::var_os("HOME").filter(|h| !h.is_empty()) {
        return Some(PathBuf::from(h));
    }
    // /proc/self belongs to the effective user; no unsafe getpwuid needed.
    use std::os::unix::fs::MetadataExt;
    let uid = fs::metadata("/proc/self").ok()?.uid().to_string();
    let passwd = fs::read_to_string("/etc/passwd").ok()?;
    passwd.lines().find_map(|line| {
        let f: Vec<&str> = line.split(':').collect();
        (f.len() >= 6 && f[2] == uid).then(|| PathBuf::from(f[5]))
    })
}

/// Looks `what` up in the file at `path`.
///
/// `Ok(None)` when the file does not exist, cannot be opened, is not a plain
/// file or is group/world accessible (the last two with a warning, as
/// libpq), or holds no matching line. Never logs a password.
pub(crate) fn lookup(path: &Path, what: &Lookup<'_>) -> Option<String> {
    // As libpq: no lookup (and no warning about the file) without both.
    if what.database.is_empty() || what.user.is_empty() {
        return None;
    }
    let mut file = match fs::File::open(path) {
        Ok(f) => f,
        Err(e) => {
            if e.kind() != io::ErrorKind::NotFound {
                tracing::debug!(path = %path.display(), error = %e, "password file not readable; ignored");
            }
            return None;
        }
    };
    let meta = file.metadata().ok()?;
    if !meta.is_file() {
        tracing::warn!(path = %path.display(), "password file is not a plain file; ignored");
        return None;
    }
    if meta.permissions().mode() & 0o077 != 0 {
        tracing::warn!(
            path = %path.display(),
            "password file has group or world access; permissions should be u=rw (0600) or less; ignored"
        );
        return None;
    }
    let mut text = String::new();
    if let Err(e) = file.read_to_string(&mut text) {
        tracing::warn!(path = %path.display(), error = %e, "password file cannot be read (not UTF-8?); ignored");
        return None;
    }
    find(&text, what)
}

/// The password of the first line of `text` that matches `what`.
pub(crate) fn find(text: &str, what: &Lookup<'_>) -> Option<String> {
    if what.database.is_empty() || what.user.is_empty() {
        return None;
    }
    let host = if what.host.is_empty() || DEFAULT_SOCKET_DIRS.contains(&what.host) {
        "localhost"
    } else {
        what.host
    };
    let port = what.port.to_string();
    text.split('\n')
        .map(|line| line.strip_suffix('\r').unwrap_or(line))
        .filter(|line| !line.is_empty() && !line.starts_with('#'))
        .find_map(|line| {
            let rest = matches_field(line, host)?;
            let rest = matches_field(rest, &port)?;
            let rest = matches_field(rest, what.database)?;
            let rest = matches_field(rest, what.user)?;
            Some(unescape_password(rest))
        })
}

/// If `line` starts with a field equal to `token` (or `*`) followed by an
/// unescaped `:`, the rest after that colon (libpq's `pwdfMatchesString`).
fn matches_field<'a>(line: &'a str, token: &str) -> Option<&'a str> {
    if let Some(rest) = line.strip_prefix("*:") {
        return Some(rest);
    }
    let mut want = token.chars().peekable();
    let mut chars = line.char_indices();
    while let Some((i, c)) = chars.next() {
        let (c, escaped) = if c == '\\' {
            match chars.next() {
                Some((_, next)) => (next, true),
                None => return None,
            }
        } else {
            (c, false)
        };
        // As libpq: an unescaped colon ends the field only once the token
        // is used up; before that it may match a colon of the token (an
        // IPv6 address written without escapes).
        if c == ':' && !escaped && want.peek().is_none() {
            return Some(&line[i + 1..]);
        }
        if want.next() != Some(c) {
            return None;
        }
    }
    None
}

/// The password field: up to the first unescaped `:` (libpq ignores any
/// further fields), with `\x` turned into `x`.
fn unescape_password(field: &str) -> String {
    let mut out = String::with_capacity(field.len());
    let mut chars = field.chars();
    while let Some(c) = chars.next() {
        match c {
            ':' => break,
            '\\' => match chars.next() {
                Some(next) => out.push(next),
                None => out.push('\\'),
            },
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn l<'a>(host: &'a str, port: u16, database: &'a str, user: &'a str) -> Lookup<'a> {
        Lookup {
            host,
            port,
            database,
            user,
        }
    }

    #[test]
    fn exact_match_and_first_match_wins() {
        let text = "db:5432:app:alice:first\ndb:5432:app:alice:second\n";
        assert_eq!(
            find(text, &l("db", 5432, "app", "alice")).as_deref(),
            Some("first")
        );
    }

    #[test]
    fn every_field_must_match() {
        let text = "db:5432:app:alice:pw\n";
        assert_eq!(find(text, &l("db2", 5432, "app", "alice")), None);
        assert_eq!(find(text, &l("db", 5433, "app", "alice")), None);
        assert_eq!(find(text, &l("db", 5432, "ap", "alice")), None);
        assert_eq!(find(text, &l("db", 5432, "app", "alic")), None);
        assert_eq!(find(text, &l("d", 5432, "app", "alice")), None);
    }

    #[test]
    fn wildcards_match_anything_but_only_as_whole_fields() {
        let text = "*:*:*:bob:bobpw\nd*:5432:app:alice:nope\n*:5432:*:alice:alicepw\n";
        assert_eq!(find(text, &l("x", 1, "y", "bob")).as_deref(), Some("bobpw"));
        assert_eq!(
            find(text, &l("db", 5432, "app", "alice")).as_deref(),
            Some("alicepw")
        );
        assert_eq!(find(text, &l("db", 5433, "app", "alice")), None);
    }

    #[test]
    fn escapes_in_fields_and_password() {
        let text = r"h\:x:5432:d\\b:u:p\:w\\d:ignored";
        assert_eq!(
            find(text, &l("h:x", 5432, r"d\b", "u")).as_deref(),
            Some(r"p:w\d")
        );
        // An escaped star is a literal star, not a wildcard.
        let text = r"\*:5432:d:u:star";
        assert_eq!(find(text, &l("h", 5432, "d", "u")), None);
        assert_eq!(find(text, &l("*", 5432, "d", "u")).as_deref(), Some("star"));
    }

    #[test]
    fn ipv6_host_with_or_without_escapes() {
        let what = l("::1", 5432, "app", "alice");
        assert_eq!(find("::1:5432:app:alice:a\n", &what).as_deref(), Some("a"));
        assert_eq!(find(r"\:\:1:5432:app:alice:b", &what).as_deref(), Some("b"));
    }

    #[test]
    fn comments_blank_lines_and_crlf() {
        let text = "# db:5432:app:alice:commented\r\n\r\ndb:5432:app:alice:pw\r\n";
        assert_eq!(
            find(text, &l("db", 5432, "app", "alice")).as_deref(),
            Some("pw")
        );
    }

    #[test]
    fn localhost_matches_no_host_and_default_socket_dirs() {
        let text = "localhost:5432:app:alice:local\n";
        for host in ["", "/var/run/postgresql", "/tmp", "localhost"] {
            assert_eq!(
                find(text, &l(host, 5432, "app", "alice")).as_deref(),
                Some("local"),
                "{host:?}"
            );
        }
        assert_eq!(find(text, &l("/srv/pg", 5432, "app", "alice")), None);
        assert_eq!(find(text, &l("127.0.0.1", 5432, "app", "alice")), None);
    }

    #[test]
    fn short_lines_and_empty_password() {
        assert_eq!(find("db:5432:app\n", &l("db", 5432, "app", "alice")), None);
        assert_eq!(
            find("db:5432:app:alice:\n", &l("db", 5432, "app", "alice")).as_deref(),
            Some("")
        );
        // No password field at all: libpq requires the fourth colon.
        assert_eq!(
            find("db:5432:app:alice", &l("db", 5432, "app", "alice")),
            None
        );
    }

    #[test]
    fn empty_user_or_database_never_matches() {
        assert_eq!(find("*:*:*:*:pw\n", &l("db", 5432, "", "alice")), None);
        assert_eq!(
            lookup(Path::new("/nonexistent"), &l("db", 5432, "app", "")),
            None
        );
    }

    #[test]
    fn file_with_group_or_world_access_is_ignored() {
        let dir = std::env::temp_dir().join(format!("pgelect-passfile-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let path = dir.join("pgpass");
        fs::write(&path, "*:*:*:*:pw\n").unwrap();
        let what = l("db", 5432, "app", "alice");
        fs::set_permissions(&path, fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(lookup(&path, &what).as_deref(), Some("pw"));
        for mode in [0o640, 0o604, 0o660, 0o610] {
            fs::set_permissions(&path, fs::Permissions::from_mode(mode)).unwrap();
            assert_eq!(lookup(&path, &what), None, "mode {mode:o}");
        }
        fs::set_permissions(&path, fs::Permissions::from_mode(0o400)).unwrap();
        assert_eq!(lookup(&path, &what).as_deref(), Some("pw"));
        // A directory is not a password file.
        assert_eq!(lookup(&dir, &what), None);
        fs::remove_dir_all(&dir).unwrap();
    }
}
