"""Box links and the boxes file: keeping an inventory view of every box current."""
