//! Passwords stay secret: malformed connection strings never echo any part
//! of their password (in `Display` or `Debug`), an ambiguous URL is refused
//! before any host name is looked up, and a password can come from a libpq
//! password file alone.

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;

use pgelect::lock::{LockMode, Wait};
use pgelect::{ConnectOptions, Error, LockKey, LockSession};
use pgelect_testkit::TestDb;

/// Every piece of `password` of 3 characters or more (split at the
/// characters that end a URL part), and the whole.
fn fragments(password: &str) -> Vec<String> {
    let mut out: Vec<String> = password
        .split(['@', ':', '/', '?', '&', '=', ' ', '\''])
        .filter(|f| f.len() >= 3)
        .map(str::to_owned)
        .collect();
    out.push(password.to_owned());
    out
}

fn assert_hidden(input: &str, password: &str, e: &Error) {
    let shown = format!("{e}\n{e:?}");
    for fragment in fragments(password) {
        assert!(
            !shown.contains(&fragment),
            "the error for {input:?} shows {fragment:?}:\n{shown}"
        );
    }
}

#[test]
fn malformed_urls_never_show_their_password() {
    // (input, the password in it)
    let cases = [
        // An unescaped '@': the driver and libpq would take `cret@db` as the host.
        ("postgres://app:se@cret@db/app", "se@cret"),
        ("postgres://app:p@ssw0rd@db:5432/app", "p@ssw0rd"),
        ("postgresql://app:a@b@c@db/app", "a@b@c"),
        ("postgres://app@x:tail1234@db/app", "tail1234"),
        // A bad port, a bad parameter value, a password split by '&'.
        ("postgres://app:hunter2@db:54x2/app", "hunter2"),
        ("postgres://app:hunter2@db/app?sslmode=bogus", "hunter2"),
        ("postgres://app@db/app?password=hun&ter2=x", "hun&ter2"),
        (
            "postgres://app@db/app?password=hunter2&sslmode=bogus",
            "hunter2",
        ),
        // Key/value strings: an unquoted space, an unterminated quote.
        (
            "host=db user=app password=hun ter2=x dbname=app",
            "hun ter2",
        ),
        ("host=db user=app password=hun ter2 dbname=app", "hun ter2"),
        ("host=db user=app password=hun ter2", "hun ter2"),
        ("host=db user=app password='hunter2", "hunter2"),
        ("host=db port=x password=hunter2", "hunter2"),
    ];
    for (input, password) in cases {
        let e = ConnectOptions::from_url(input).expect_err(&format!("{input:?} should be refused"));
        assert!(matches!(e, Error::Config(_)), "{input:?}: {e:?}");
        assert_hidden(input, password, &e);
    }
}

#[test]
fn an_ambiguous_at_sign_is_refused_with_advice_before_any_lookup() {
    // Refused by parsing alone: nothing is connected, so nothing resolves
    // `cret@db` (a `ConnectOptions` is never built).
    let e = ConnectOptions::from_url("postgres://app:se@cret@db/app").unwrap_err();
    let text = e.to_string();
    assert!(text.contains("%40"), "{text}");
    assert!(text.contains("postgres://app:***@…"), "{text}");
    // Percent-encoded, the same password is accepted and kept intact.
    let o = ConnectOptions::from_url("postgres://app:se%40cret@db/app").unwrap();
    assert_eq!(o.target(), "db:5432/app user=app");
    assert_eq!(o.driver_config().get_password(), Some(&b"se@cret"[..]));
}

#[test]
fn errors_show_the_url_with_the_password_redacted() {
    let e =
        ConnectOptions::from_url("postgres://app:hunter2@db:54x2/app?sslmode=require").unwrap_err();
    let text = e.to_string();
    assert!(text.contains("postgres://app:***@db:54x2/app?…"), "{text}");
    assert!(text.contains("invalid value for option `port`"), "{text}");
}

#[test]
fn key_value_strings_are_accepted_and_debug_hides_their_password() {
    for input in [
        "host=db.internal port=5433 user=app password=hunter2 dbname=app",
        "host=db.internal port=5433 user=app password='hun ter2' dbname=app",
        "postgres://app:hunter2@db.internal:5433/app",
    ] {
        let o = ConnectOptions::from_url(input).unwrap();
        assert_eq!(o.target(), "db.internal:5433/app user=app");
        assert!(o.has_password());
        let debug = format!("{o:?}");
        assert!(!debug.contains("hun"), "{debug}");
        assert!(debug.contains("<redacted>"), "{debug}");
    }
}

/// A private directory with a password file of `mode`.
struct PassFile {
    dir: PathBuf,
    path: PathBuf,
}

impl PassFile {
    fn new(hint: &str, text: &str, mode: u32) -> PassFile {
        let dir =
            std::env::temp_dir().join(format!("pgelect-secrets-{hint}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("pgpass");
        std::fs::write(&path, text).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        PassFile { dir, path }
    }
}

impl Drop for PassFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[tokio::test]
async fn a_password_from_a_password_file_alone_connects() {
    let db = TestDb::new("pgpass").await;
    let password = "from-the-file:with\\colon";
    db.create_role("pgpass", password, false).await;
    let role = db.role_name("pgpass");
    let addr = db.server_addr();
    let url = format!(
        "postgres://{role}@{}:{}/{}",
        addr.ip(),
        addr.port(),
        db.name()
    );
    let escaped = password.replace('\\', "\\\\").replace(':', "\\:");
    // A wrong password for another database first (first match wins, so it
    // must not be taken), then wildcards.
    let text = format!(
        "# pgelect test\n{ip}:{port}:otherdb:{role}:wrong\n{ip}:*:{db}:{role}:{escaped}\n*:*:*:*:wrong-too\n",
        ip = addr.ip(),
        port = addr.port(),
        db = db.name()
    );

    // Without the file there is no password, and the server refuses.
    let none = ConnectOptions::from_url(&url).unwrap();
    assert!(!none.has_password());
    let e = LockSession::connect(&none).await.unwrap_err();
    // The server asks for a password the client does not have.
    assert!(
        matches!(e, Error::Auth { .. }) || format!("{e:?}").contains("password missing"),
        "{e:?}"
    );

    let file = PassFile::new("ok", &text, 0o600);
    let options = ConnectOptions::from_url(&url)
        .unwrap()
        .password_file(&file.path);
    assert!(options.has_password());
    let session = LockSession::connect(&options)
        .await
        .expect("connects with the password from the file");
    let guard = session
        .acquire(
            LockKey::from_name("pgpass-test").unwrap(),
            LockMode::Exclusive,
            Wait::Never,
        )
        .await
        .unwrap()
        .expect("the lock is free");
    assert!(guard.release().await.unwrap());

    // Group-readable: ignored, as libpq does.
    let loose = PassFile::new("loose", &text, 0o640);
    let options = ConnectOptions::from_url(&url)
        .unwrap()
        .password_file(&loose.path);
    assert!(!options.has_password());
}
