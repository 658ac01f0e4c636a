"""Tools that prove CP is invisible: layer probes and parity runs against no-CP references."""
