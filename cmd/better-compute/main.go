// Command better-compute is the control plane's CLI and servers.
package main

import (
	"context"
	"os"

	"github.com/better-compute/better-compute/internal/cli"
)

func main() {
	os.Exit(cli.Main(context.Background(), os.Args[1:], cli.Env{Stdin: os.Stdin, Stdout: os.Stdout, Stderr: os.Stderr}))
}
