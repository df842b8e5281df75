"""Graph passes: match communication + computation subgraphs and rewrite them into kosmos ops."""
