"""Kiln models inside apps: `kiln package` bundles the compiled static libraries and weights per
platform."""
