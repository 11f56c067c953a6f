"""The gradient index: each example's projected gradient written once (``index``), then queried
by any number of references (``query``), re-ranked exactly where asked."""
