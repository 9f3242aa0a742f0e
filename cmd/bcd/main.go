// Command bcd is the better-compute node daemon; see internal/bcd/cli.
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	"github.com/better-compute/better-compute/internal/bcd/cli"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := cli.Main(ctx, os.Args[1:], cli.Env{})
	stop()
	os.Exit(code)
}
