//! sluice's own HTTP/2 server: frames ([`frame`]), header compression
//! ([`hpack`], [`huffman`]), request heads ([`request`]), request bodies
//! ([`body`]) and the connection that serves them all ([`conn`]).

pub mod body;
pub mod conn;
pub mod frame;
pub mod hpack;
pub mod huffman;
pub mod request;

pub use body::RecvBody;
pub use conn::{ConnError, Connection, Settings};

#[cfg(test)]
mod conn_props;
#[cfg(test)]
mod props;
