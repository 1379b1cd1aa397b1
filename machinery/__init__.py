"""The machinery beside the book: TODO."""
