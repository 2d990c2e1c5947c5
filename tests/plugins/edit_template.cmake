# Copies IN to OUT with one more line: the "edited template" of the changed-plugin test.
file(READ ${IN} body)
file(WRITE ${OUT} "${body}// edited after release: a rebuilt plugin must not be served the old kernels\n")
