"""Where an object's bytes live and how the processes of one host share them."""
