// Package check decodes the Kubernetes manifests of deploy/kubernetes
// strictly with client-go's scheme and asserts their security properties
// offline. It is its own module so that the product's module never depends
// on Kubernetes.
package check
