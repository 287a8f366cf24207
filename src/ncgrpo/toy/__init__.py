"""The embedded default: a synthetic visual-math suite, a tiny base vision-language model, its
warm-start (``ncgrpo pretrain``) and the miniature protocol (``ncgrpo demo``).

The library never imports this package; it imports the library."""
