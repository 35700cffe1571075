//! sluice's own HTTP/2 codec: frames ([`frame`]) and header compression
//! ([`hpack`], [`huffman`]), for a server of its own.

pub mod frame;
pub mod hpack;
pub mod huffman;

#[cfg(test)]
mod props;
