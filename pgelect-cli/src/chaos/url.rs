//! Pointing a database URL at another address (a proxy, the namespaces'
//! bridge).
//!
//! Which server a URL names is the library's reading of it
//! ([`pgelect::ConnectOptions::from_url`]), the one the candidates act on.
//! Only the URL's authority (`[user[:password]@]host[:port]`) is replaced
//! here, and the result is read back the same way: a URL that the library
//! would then read as anything but the one new address (a host or port also
//! given as a parameter, several hosts, `hostaddr`, a Unix socket) is not
//! pointed elsewhere, and the faults that need that are skipped.

use std::net::{Ipv4Addr, SocketAddr};

/// A single-host `postgres://` URL taken apart, to point it elsewhere.
pub(super) struct UrlParts {
    /// `postgres://` or `postgresql://`.
    scheme: &'static str,
    /// `user:password@` or empty.
    userinfo: String,
    /// `/database?params`.
    tail: String,
    /// The server's address.
    pub(super) addr: SocketAddr,
}

impl UrlParts {
    /// `None` unless `url` is a `postgres://` URL naming one TCP server in
    /// its authority, and nowhere else (network faults are then skipped).
    pub(super) async fn parse(url: &str) -> Option<UrlParts> {
        let (host, port) = one_tcp_server(url)?;
        let scheme = ["postgresql://", "postgres://"]
            .into_iter()
            .find(|p| url.starts_with(p))?;
        let rest = &url[scheme.len()..];
        let end = rest.find(['/', '?']).unwrap_or(rest.len());
        let (authority, tail) = rest.split_at(end);
        let userinfo = authority
            .rsplit_once('@')
            .map(|(u, _)| format!("{u}@"))
            .unwrap_or_default();
        let parts = UrlParts {
            scheme,
            userinfo,
            tail: tail.to_owned(),
            addr: SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
        };
        // Pointed elsewhere, the URL must name that address alone.
        let moved = parts.to("127.0.0.1", 1, None);
        if one_tcp_server(&moved) != Some(("127.0.0.1".to_owned(), 1)) {
            return None;
        }
        let addr = tokio::net::lookup_host((host.as_str(), port))
            .await
            .ok()?
            .next()?;
        Some(UrlParts { addr, ..parts })
    }

    /// The URL with the host and port replaced, and the user and password
    /// if `user` is given.
    pub(super) fn to(&self, host: &str, port: u16, user: Option<(&str, &str)>) -> String {
        let userinfo = match user {
            Some((u, p)) => format!("{u}:{p}@"),
            None => self.userinfo.clone(),
        };
        format!("{}{userinfo}{host}:{port}{}", self.scheme, self.tail)
    }
}

/// The host and port of the one TCP server `url` names, as the library
/// reads it, if it names exactly one.
fn one_tcp_server(url: &str) -> Option<(String, u16)> {
    pgelect::ConnectOptions::from_url(url)
        .ok()?
        .single_tcp_server()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_url_is_pointed_elsewhere_only_where_its_authority_alone_names_the_server() {
        let p = UrlParts::parse("postgres://app:pw@127.0.0.1:5433/db?sslmode=disable")
            .await
            .expect("a single-host URL");
        assert_eq!(p.addr, SocketAddr::from((Ipv4Addr::LOCALHOST, 5433)));
        assert_eq!(
            p.to("10.0.0.1", 6000, None),
            "postgres://app:pw@10.0.0.1:6000/db?sslmode=disable"
        );
        assert_eq!(
            p.to("10.0.0.1", 6000, Some(("u", "s"))),
            "postgres://u:s@10.0.0.1:6000/db?sslmode=disable"
        );
        for url in [
            "postgres://a,b/db",
            "postgres://127.0.0.1/db?host=127.0.0.2",
            "postgres://127.0.0.1/db?port=5433",
            "postgres:///db?host=127.0.0.1",
            "postgres://127.0.0.1/db?hostaddr=127.0.0.1",
            "host=127.0.0.1 dbname=db",
        ] {
            assert!(UrlParts::parse(url).await.is_none(), "{url}");
        }
    }
}
