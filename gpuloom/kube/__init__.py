"""gpuloom on Kubernetes, the pure part: what a Pod asks for (its gpuloom resources and
annotations, validated, as a placement job spec), the admission webhook's answer, and the
scheduler extender's messages. Plain data in and out, no I/O: services/k8s/ serves them."""
