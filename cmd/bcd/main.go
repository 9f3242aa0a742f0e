// Command bcd is the better-compute node daemon; see internal/node/bcdcmd.
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	"github.com/better-compute/better-compute/internal/node/bcdcmd"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := bcdcmd.Main(ctx, os.Args[1:], bcdcmd.Env{})
	stop()
	os.Exit(code)
}
