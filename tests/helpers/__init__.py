"""What the tests share and that is not a test: tiny models, assets, servers, browsers, references."""
